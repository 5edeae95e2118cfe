#!/usr/bin/env python3
"""The greedy block-diffusion decode loop of the block-causal families (SDAR, LLaDA2.0), written
from the decoding description (../../shared/spec/diffusion-lms-and-focus.md §3.5, llada2.md), not
from Ponder's Rust code, over any forward that gives a canvas's logits. No cache: every step is a
forward over the canvas up to the current block's end.

- The canvas is the prompt, then mask tokens up to a block boundary past prompt + gen; blocks are
  aligned to position 0, so a partial prompt block is part of the first decode block.
- Per step, for the current block's masked positions: the greedy token and its probability (the
  mask token excluded from the softmax); which are revealed is the policy's — `("threshold", τ)`:
  every one with probability >= τ, at least the most probable (LMDeploy's low_confidence_dynamic);
  `("static", n)`: the n most probable (low_confidence_static). Ties go to the lower position.
  Revealed tokens stay (no remasking).
- After a block that holds an EOS the loop stops; the output is cut after the first EOS.

These follow the deterministic servers (LMDeploy, dInfer) where the released loops differ (the
HF helper samples at temperature 0 and accepts at p > τ).

With a `draw` (diffusion_sampling.Draw) a step samples its tokens as SDAR's and LLaDA2.0's
`sample_with_temperature_topk_topp` does (top-k, then top-p) and ranks them by the drawn token's
probability; the step count keying the draws counts the request's forwards.
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from diffusion_sampling import sample  # noqa: E402


def generate(logits_of, mask_id, prompt, gen, block, policy, eos=(), margins=None, draw=None):
    """`logits_of(canvas)`: logits `[len(canvas), vocab]` under block-causal attention. With a
    list as `margins`, each step appends how close it came to deciding otherwise: the smallest of
    the probability gaps between a masked position's best and second-best token, between the last
    revealed and the first kept position, and between any probability and τ — a decode whose
    margins all exceed the f32 engine's error is one the engine must reproduce exactly. Sampled
    decodes (`draw`) record each draw's margin instead of the best-token gap."""
    kind, value = policy
    assert kind in ("threshold", "static"), policy
    p = len(prompt)
    total = -(-(p + gen) // block) * block
    canvas = list(prompt) + [mask_id] * (total - p)
    n = 0  # forwards run
    for start in range(p // block * block, total, block):
        end = start + block
        while any(canvas[i] == mask_id for i in range(max(start, p), end)):
            logits = torch.as_tensor(logits_of(canvas[:end]))[start:end].clone()
            logits[:, mask_id] = float("-inf")
            probs = logits.softmax(-1)
            top2 = probs.topk(2, dim=-1).values
            conf, x0 = probs.max(-1)
            masked = [i for i in range(max(start, p), end) if canvas[i] == mask_id]
            drawn = {}
            if draw is not None:
                sampler = draw.sampler or "k_then_p"
                conf, x0 = conf.clone(), x0.clone()
                for i in masked:
                    drawn[i] = sample(logits[i - start].double().numpy(), draw, n, i, sampler)
                    x0[i - start], conf[i - start] = drawn[i][0], drawn[i][1]
            n += 1
            ranked = sorted(masked, key=lambda i: (-conf[i - start].item(), i))
            if kind == "threshold":
                pick = [i for i in ranked if conf[i - start] >= value] or ranked[:1]
            else:
                pick = ranked[: int(value)]
            if margins is not None:
                gaps = [drawn[i][2] if drawn else float(top2[i - start, 0] - top2[i - start, 1]) for i in masked]
                if len(pick) < len(ranked):
                    gaps.append(float(conf[pick[-1] - start] - conf[ranked[len(pick)] - start]))
                if kind == "threshold":
                    gaps += [abs(float(conf[i - start]) - value) for i in masked]
                margins.append(min(gaps))
            for i in pick:
                canvas[i] = int(x0[i - start])
        if any(t in eos for t in canvas[p:end]):
            break
    out = canvas[p : p + gen]
    for j, t in enumerate(out):
        if t in eos:
            return out[: j + 1]
    return out
