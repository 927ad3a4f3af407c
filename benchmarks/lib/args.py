"""Command-line pieces that several scripts spell the same way."""

from __future__ import annotations

import argparse


def int_list(text: str) -> list[int]:
    """An argparse ``type``: "1,8,32" -> [1, 8, 32] (string defaults are parsed too)."""
    return [int(part) for part in text.split(",")]


def add_threads(ap: argparse.ArgumentParser) -> None:
    """``--threads``: torch's thread count for the run (``apply_threads`` sets it)."""
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)


def add_checkpoint(ap: argparse.ArgumentParser) -> None:
    """``--smoke`` and ``--model`` of the GPU checks that measure one random checkpoint."""
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    ap.add_argument("--model", help="a checkpoint directory (default: write a random one)")
