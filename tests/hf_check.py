#!/usr/bin/env python3
"""Hugging Face `transformers` loads what `ember export` writes, unchanged, and scores text
exactly as `ember eval` does.

For a checkpoint (sharded or not) this script:

1. runs `ember export --checkpoint CKPT --out EXPORT` (f32);
2. runs `ember eval --checkpoint CKPT --data TEXT`;
3. loads EXPORT with `GPT2LMHeadModel.from_pretrained` and its `tokenizer.json` with
   `tokenizers`, and scores TEXT on the same windows `ember eval` uses: consecutive,
   non-overlapping windows of the training context, each token but the first predicted once;
4. fails unless the two mean losses agree within 1e-4.

Needs `torch`, `transformers` and `tokenizers` (`pip install torch transformers tokenizers`).
Exit codes: 0 agreement, 1 mismatch, 3 a dependency is missing.

    python3 tests/hf_check.py --ember target/release/ember --checkpoint out --data text.txt
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

TOLERANCE = 1e-4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ember", required=True, help="path of the ember binary")
    parser.add_argument("--checkpoint", required=True, help="checkpoint dir or out dir")
    parser.add_argument("--data", required=True, help="a text file to score")
    parser.add_argument("--export", help="where to export (default: a temporary directory)")
    args = parser.parse_args()
    try:
        import torch
        from tokenizers import Tokenizer
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"hf_check: {e}; install torch, transformers and tokenizers", file=sys.stderr)
        return 3

    export = Path(args.export or tempfile.mkdtemp(prefix="ember-hf-"))
    subprocess.run(
        [args.ember, "export", "--checkpoint", args.checkpoint, "--out", str(export)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    ember = json.loads(
        subprocess.run(
            [args.ember, "eval", "--checkpoint", args.checkpoint, "--data", args.data],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )

    ckpt = Path(args.checkpoint)
    if not (ckpt / "manifest.json").exists():
        ckpt = max(ckpt.glob("step-*"), key=lambda p: int(p.name[5:]))
    block = json.loads((ckpt / "manifest.json").read_text())["train"]["block_size"]

    model = GPT2LMHeadModel.from_pretrained(export, torch_dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    ids = tokenizer.encode(Path(args.data).read_text(), add_special_tokens=False).ids
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, block):
            length = min(block, len(ids) - 1 - start)
            x = torch.tensor([ids[start : start + length]])
            y = torch.tensor([ids[start + 1 : start + length + 1]])
            logits = model(x).logits[0]
            loss = torch.nn.functional.cross_entropy(logits, y[0], reduction="sum")
            total += loss.item()
            count += length
    hf_loss = total / count
    diff = abs(hf_loss - ember["loss"])
    print(
        json.dumps(
            {
                "ember_loss": ember["loss"],
                "hf_loss": hf_loss,
                "tokens": count,
                "ember_tokens": ember["tokens"],
                "abs_diff": diff,
            }
        )
    )
    if count != ember["tokens"] or not math.isfinite(hf_loss) or diff > TOLERANCE:
        print(f"hf_check: mismatch (tolerance {TOLERANCE})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
