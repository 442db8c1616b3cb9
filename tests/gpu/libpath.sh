# Sourced by the GPU scripts: every directory holding libcublas / libnvrtc (CUDA toolkit, or the
# nvidia-* pip wheels torch brings) goes on LD_LIBRARY_PATH for cudarc's dynamic loading.
libdirs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
bases = site.getsitepackages() + ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib", "/usr/lib/x86_64-linux-gnu"]
for base in bases:
    for pat in ("libcublas.so*", "libcublasLt.so*", "libnvrtc.so*"):
        for f in glob.glob(os.path.join(base, "**", pat), recursive=True):
            d = os.path.dirname(f)
            if "stubs" not in d and d not in dirs:
                dirs.append(d)
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
