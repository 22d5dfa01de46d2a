"""Random-weight GGUFs of the GPU benchmark's shapes (SmolLM2-135M Q4_1 and Llama-3.1-8B Q4_0,
the shapes and types llama-bench is compared on): speed does not depend on the weights'
values, and the real files are larger than what a device call may carry.

    python bench/gpu_models.py DIR [--only smollm2|llama8b]

- DIR/smollm2-shape-q4_1.gguf: SmolLM2-135M's shape (576 wide, 30 layers, 9 heads over 3 KV
  heads, FFN 1536, vocabulary 49152, rope base 1e5, tied classifier), every matrix Q4_1 and
  token_embd Q8_0, as the real Q4_1 file.
- DIR/llama8b-shape-q4_0.gguf: Llama-3.1-8B's shape (4096 wide, 32 layers, 32 heads over 8 KV
  heads, FFN 14336, rope base 5e5 with Llama-3.1's rope_freqs, untied) with a 49152 vocabulary;
  every matrix Q4_0, output.weight Q6_K (llama-quantize's choice); 3.9 GiB.

The blocks are random bytes with their scale fields set to small finite halves, tiled from
256 random rows per tensor so that writing 4 GiB takes seconds. The vocabulary is the tests'
tiny one padded to 49152 pieces (tests/python/_tiny_models.py).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# (block values, block bytes, ((offset of an f16 field, its value), ...)) per type
BLOCKS = {
    "Q4_0": (32, 18, ((0, 0.01),)),
    "Q4_1": (32, 20, ((0, 0.01), (2, -0.08))),
    "Q8_0": (32, 34, ((0, 0.001),)),
    "Q6_K": (256, 210, ((208, 0.0005),)),
}

SHAPES = {
    "smollm2": dict(file="smollm2-shape-q4_1.gguf", n_embd=576, n_layer=30, n_head=9, n_head_kv=3, n_ff=1536,
                    rope_base=1e5, tied=True, wtype="Q4_1", embd="Q8_0", out=None, rope_freqs=False),
    "llama8b": dict(file="llama8b-shape-q4_0.gguf", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336,
                    rope_base=5e5, tied=False, wtype="Q4_0", embd="Q4_0", out="Q6_K", rope_freqs=True),
}
N_VOCAB = 49152


def random_blocks(rows: int, cols: int, qtype: str, rng) -> np.ndarray:
    values, nbytes, fields = BLOCKS[qtype]
    nblocks = cols // values
    base = rng.integers(0, 256, size=(min(rows, 256), nblocks, nbytes), dtype=np.uint8)
    for off, value in fields:
        base[:, :, off:off + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    reps = -(-rows // base.shape[0])
    return np.tile(base, (reps, 1, 1))[:rows].reshape(rows, nblocks * nbytes)


def llama31_rope_freqs(head_dim: int, base: float) -> np.ndarray:
    """Llama-3.1's frequency factors (factor 8, low 1, high 4, original context 8192)."""
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi / base ** (-i / head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write(shape: dict, path: Path) -> Path:
    import gguf
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import _tiny_models as tm

    rng = np.random.default_rng(0)
    E, F, L = shape["n_embd"], shape["n_ff"], shape["n_layer"]
    D = E // shape["n_head"]
    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_name(f"pykv-random-{path.stem}")
    wr.add_context_length(131072)
    wr.add_embedding_length(E)
    wr.add_block_count(L)
    wr.add_feed_forward_length(F)
    wr.add_head_count(shape["n_head"])
    wr.add_head_count_kv(shape["n_head_kv"])
    wr.add_rope_dimension_count(D)
    wr.add_rope_freq_base(shape["rope_base"])
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(N_VOCAB)
    tokens, scores, types = tm.tiny_vocab(N_VOCAB)
    wr.add_tokenizer_model("llama")
    wr.add_token_list(tokens)
    wr.add_token_scores(scores)
    wr.add_token_types(types)
    wr.add_bos_token_id(tm.BOS_ID)
    wr.add_eos_token_id(tm.EOS_ID)

    def matrix(name, rows, cols, qtype):
        wr.add_tensor(name, random_blocks(rows, cols, qtype, rng), raw_dtype=gguf.GGMLQuantizationType[qtype])

    ones = np.ones(E, dtype=np.float32)
    matrix("token_embd.weight", N_VOCAB, E, shape["embd"])
    if shape["rope_freqs"]:
        wr.add_tensor("rope_freqs.weight", llama31_rope_freqs(D, shape["rope_base"]))
    kv = shape["n_head_kv"] * D
    for il in range(L):
        p = f"blk.{il}."
        wr.add_tensor(p + "attn_norm.weight", ones)
        matrix(p + "attn_q.weight", E, E, shape["wtype"])
        matrix(p + "attn_k.weight", kv, E, shape["wtype"])
        matrix(p + "attn_v.weight", kv, E, shape["wtype"])
        matrix(p + "attn_output.weight", E, E, shape["wtype"])
        wr.add_tensor(p + "ffn_norm.weight", ones)
        matrix(p + "ffn_gate.weight", F, E, shape["wtype"])
        matrix(p + "ffn_up.weight", F, E, shape["wtype"])
        matrix(p + "ffn_down.weight", E, F, shape["wtype"])
    wr.add_tensor("output_norm.weight", ones)
    if not shape["tied"]:
        matrix("output.weight", N_VOCAB, E, shape["out"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for the files")
    p.add_argument("--only", choices=sorted(SHAPES), help="write one of them")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, shape in SHAPES.items():
        if args.only and name != args.only:
            continue
        path = out / shape["file"]
        if not path.exists():
            write(shape, path)
        print(path)


if __name__ == "__main__":
    main()
