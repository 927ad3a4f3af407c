"""The small bf16 CPU kernels between the GEMMs (``cpu_native.silu_and_mul``,
``argmax_rows``) against the torch ops they replace, and the sampler's greedy fast path
against its general path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.core.request import Request, Sequence
from llmserve.core.sampling_params import SamplingParams
from llmserve.kernels.cpu import native as cpu_native
from llmserve.model_executor.layers.sampler import Sampler, greedy_tokens
from tests.forced_isa import run_as


@pytest.fixture(autouse=True)
def _native_kernel_builds():
    assert cpu_native.cpu_library() is not None, "the CPU kernels did not build"


@pytest.mark.parametrize("rows, intermediate", [(1, 1536), (3, 1536), (64, 1536), (5, 300),
                                                (2, 17)])
def test_silu_and_mul_is_torchs_silu_times_up(rows, intermediate):
    """The same bits as F.silu(gate) * up on bf16 (a unit of difference allowed where
    the float32 value sits on a rounding boundary: it never did on these draws), over
    wide inputs, partial chunks and widths that are not a multiple of the vector."""
    torch.manual_seed(rows * intermediate)
    gate_up = (torch.randn(rows, 2 * intermediate) * 4).bfloat16()
    got = cpu_native.silu_and_mul(gate_up, intermediate)
    gate, up = gate_up.split(intermediate, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    assert (got == want).float().mean() > 0.999


def test_silu_and_mul_keeps_leading_dims_and_special_values():
    gate_up = torch.tensor([[[0.0, -100.0, 100.0, float("inf"), -87.5, -1e30, float("nan"),
                             1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]]).bfloat16()
    got = cpu_native.silu_and_mul(gate_up, 7)
    gate, up = gate_up.split(7, dim=-1)
    assert got.shape == (1, 1, 7)
    want = F.silu(gate) * up
    assert torch.equal(got[..., :6], want[..., :6]) and got[..., 6].isnan().all()


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (7, 49152), (32, 1000), (3, 15), (2, 16)])
def test_argmax_rows_is_torchs_argmax(rows, vocab):
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab).bfloat16()
    assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1))
    # a column slice (the sampler cuts padded vocabularies): rows stay strided
    assert torch.equal(cpu_native.argmax_rows(logits[:, : vocab - 3]),
                       logits[:, : vocab - 3].argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nans_as_torch():
    logits = torch.randn(5, 100).bfloat16()
    logits[0, 40:60] = 50.0                   # ties: the first
    logits[1, 7] = logits[1, 3] = float("nan")  # a NaN wins, the first one
    logits[2] = float("-inf")                 # all -inf: index 0
    logits[3, 99] = float("inf")              # in the tail past the last full vector
    logits[4, 98] = float("nan")
    assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1))
    assert cpu_native.argmax_rows(logits).tolist()[:4] == [40, 3, 0, 99]


def test_the_avx2_builds_argmax_is_torchs_argmax():
    """The AVX2 build's own argmax (8-lane registers, compare masks): every case above,
    on the kernels built as for an AVX2-only CPU."""
    script = """
import torch
from llmserve.kernels.cpu import native
assert native.cpu_library() is not None
assert native.panel_int8_block_n() == 32  # only the AVX2 build's int8 panels read 32
for rows, vocab in [(1, 49152), (7, 49152), (32, 1000), (3, 15), (2, 16), (4, 23), (2, 5)]:
    torch.manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab).bfloat16()
    for x in (logits, logits[:, : vocab - 3]):
        print(torch.equal(native.argmax_rows(x), x.argmax(dim=-1)))
logits = torch.randn(6, 100).bfloat16()
logits[0, 40:60] = 50.0
logits[1, 7] = logits[1, 3] = float("nan")
logits[2] = float("-inf")
logits[3, 99] = float("inf")
logits[4, 98] = float("nan")
logits[5, 17], logits[5, 9] = 0.0, -0.0
logits[5] = torch.where(logits[5] > 0, -logits[5], logits[5])
print(torch.equal(native.argmax_rows(logits), logits.argmax(dim=-1)))
print(native.argmax_rows(logits).tolist())
# a lone NaN in the second 8 lanes of a 16-wide step (the first 8 hold the maximum)
for n, at in [(16, 8), (48, 24), (48, 47), (7, 5)]:
    row = torch.randn(1, n).bfloat16()
    row[0, 0] = 100.0
    row[0, at] = float("nan")
    print(native.argmax_rows(row).item() == at)
"""
    lines = run_as("avx2", script)
    assert lines[:15] == ["True"] * 15 and lines[16:] == ["True"] * 4
    assert lines[15].startswith("[40, 3, 0, 99, 98, ")


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(Request(f"r{i}", None, [1, 2, 3], p), 0, [1, 2, 3])
            for i, p in enumerate(params)]


def test_the_greedy_fast_path_picks_what_the_float_path_picks():
    """bf16 logits straight to the C argmax (no float32 copy) give the tokens that the
    general path (float32, then argmax) gives, and the fast path is the one taken."""
    torch.manual_seed(0)
    logits = torch.randn(6, 1000).bfloat16()
    sampler = Sampler(vocab_size=990, eos_token_ids={2})
    plain = sampler(logits, _seqs([SamplingParams(temperature=0, max_tokens=4)] * 6))
    want = logits[:, :990].float().argmax(dim=-1).tolist()
    assert plain.token_ids == want
    assert plain.logprobs == [None] * 6
    # one row asking for logprobs sends the batch down the general path: same tokens
    mixed = [SamplingParams(temperature=0, max_tokens=4)] * 5 + [
        SamplingParams(temperature=0, max_tokens=4, logprobs=2)]
    general = sampler(logits, _seqs(mixed))
    assert general.token_ids == want and general.logprobs[5] is not None
    assert greedy_tokens(logits[:, :990]).tolist() == want


def test_min_tokens_still_bans_eos_for_greedy_rows():
    """A greedy row still due to reach min_tokens is not plain greedy: its EOS stays
    banned even where EOS has the largest logit."""
    logits = torch.zeros(2, 50).bfloat16()
    logits[:, 2] = 10.0  # EOS the argmax
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0, max_tokens=8, min_tokens=3),
              SamplingParams(temperature=0, max_tokens=8)]
    out = Sampler(vocab_size=50, eos_token_ids={2})(logits, _seqs(params))
    assert out.token_ids == [7, 2]


def test_the_library_is_built_and_loaded_once_per_process(monkeypatch):
    """Every bf16 op asks cpu_library() for the library, several times a step: it must
    be the one loaded object, not a compiler check, a hash of the sources and a dlopen
    each time (a step of one stream took 3x as long when the cache was lost)."""
    first = cpu_native.cpu_library()

    def no_compiler(*args, **kwargs):
        raise AssertionError("cpu_library() ran the compiler check again")

    monkeypatch.setattr(cpu_native.subprocess, "run", no_compiler)
    assert cpu_native.cpu_library() is first
    assert cpu_native.argmax_applies(torch.ones(2, 8, dtype=torch.bfloat16))
