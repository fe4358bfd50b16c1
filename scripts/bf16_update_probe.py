"""How much of a model one small AdamW step changes: fp32 master weights (the trainer's bf16
mode: fp32 parameters, bf16 autocast forward) against AdamW on bf16 parameters.

    python scripts/bf16_update_probe.py MODEL_DIR [--lr 1e-6]

MODEL_DIR is a Hugging Face directory, e.g. the packaged SmolLM2-135M-Instruct made by
``echoloss.pretrained.materialize("smollm2-135m-instruct")``. Prints the fraction of parameter
elements that changed in each mode.
"""

from __future__ import annotations

import argparse

import torch

from echoloss.train.model import load_model


def _fraction_changed(path: str, lr: float, master: bool) -> float:
    dtype = torch.float32 if master else torch.bfloat16
    model, tok = load_model(path, dtype=dtype, attn_implementation="sdpa")
    before = [p.detach().clone() for p in model.parameters()]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Walk to the goal."}, {"role": "assistant", "content": "up"}],
        tokenize=False,
    )
    ids = torch.tensor([tok(text)["input_ids"]])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=master):
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    opt.step()
    changed = total = 0
    for b, p in zip(before, model.parameters(), strict=True):
        changed += int((b != p.detach()).sum())
        total += b.numel()
    return changed / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--lr", type=float, default=1e-6)
    args = ap.parse_args()
    torch.manual_seed(0)
    for master in (True, False):
        what = "fp32 master weights, bf16 forward" if master else "bf16 parameters"
        frac = _fraction_changed(args.model, args.lr, master)
        print(f"{what}: {100 * frac:.3f} % of the parameters changed (lr {args.lr:g})")


if __name__ == "__main__":
    main()
