"""Random-weight Llama GGUFs in the usual quantisations, for timing pykv's K-quant and IQ4
kernels against llama.cpp (SmolLM2's 576-wide rows are not a multiple of 256, so its K-quant
files are mostly Q5_0/Q8_0).

    python bench/kquant_models.py --llamacpp-python /tmp/lcpp-venv/bin/python --out /tmp
    python bench/compare_llamacpp.py --model /tmp/rand-1024-Q4_K_M.gguf ...

Writes rand-1024-f16.gguf (hidden 1024, 12 layers, 16 heads / 4 KV heads, FFN 2816, the
tests' tiny vocabulary) with the tests' fixture writer, then quantises it with llama.cpp's own
quantizer (llama_model_quantize, through llama-cpp-python in its environment) to each --types
entry: the files are llama.cpp's, so both engines read the same blocks.
"""
import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUANTIZE = """
import ctypes, sys, llama_cpp
src, dst, name = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + name)
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)))
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llamacpp-python", required=True, help="python of the environment with llama-cpp-python")
    p.add_argument("--out", default="/tmp")
    p.add_argument("--types", default="Q4_K_M,Q3_K_M,Q2_K,IQ4_XS,Q4_1")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import _tiny_models as tm

    spec = tm.TinySpec("rand_1024", n_embd=1024, n_layer=12, n_head=16, n_head_kv=4, n_ff=2816, wtype="F16",
                       n_ctx_train=4096, seed=9)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    f16 = Path(args.out) / "rand-1024-f16.gguf"
    tm.write_tiny_gguf(spec, f16)
    for name in args.types.split(","):
        dst = Path(args.out) / f"rand-1024-{name}.gguf"
        subprocess.run([args.llamacpp_python, "-c", QUANTIZE, str(f16), str(dst), name], check=True,
                       capture_output=True)
        print(dst)


if __name__ == "__main__":
    main()
