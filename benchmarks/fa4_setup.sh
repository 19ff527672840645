# shellcheck shell=bash
# flash-attn-4 (FA4) as a benchmark peer on a GPU machine without access to a package index, in two parts.
#
# FA4 is pure Python over nvidia-cutlass-dsl, whose CUDA 13 library wheel (~92 MB) is larger than what one
# transfer to such a machine may hold (64 MiB). So that wheel travels unpacked, as one `tar | xz -9e` stream split
# in two byte ranges (.fa4a/ and .fa4b/, copied to the machine one after the other):
#
#   bash benchmarks/fa4_setup.sh part1                       # with .fa4a/ present
#   source benchmarks/fa4_setup.sh part2 && bash benchmarks/gpu_run.sh quick     # with .fa4b/ present
#            (any steps after the `&&`; `source ... part2 check &&` also runs a small forward
#             against SDPA first; `source ... part2 && python3 ...` works the same way)
#
#   part1   copies .fa4a/cu13.tar.xz.part1 to /root/fa4 (FA4_STASH), where part2 finds it
#           and prints the versions of the packages FA4 takes from the image.
#   part2   1. pip install --no-deps --target /tmp/site the small wheels in .fa4b/ (FIRST: pip
#              --target --upgrade replaces the whole nvidia_cutlass_dsl/ folder);
#           2. joins /root/fa4/cu13.tar.xz.part1 + .fa4b/cu13.tar.xz.part2, checks its sha256,
#              untars it into /tmp/site (adds nvidia_cutlass_dsl/cu13/ and the cu13 _cutlass_ir .so);
#           3. exports PYTHONPATH=src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages and also
#              writes those two folders into a .pth file in python3's site-packages, because
#              benchmarks/gpu_run.sh resets PYTHONPATH=src;
#           4. checks `python3 -c "from flash_attn.cute import flash_attn_func"`.
#   check   (after part2, or as `part2 check`) a small causal bf16 forward against SDPA.
#
# Sourced, it returns non-zero on failure instead of exiting the caller's shell.
#
# The ignored folders (not committed; rebuild them as below if missing):
#   .fa4a/  cu13.tar.xz.part1 (the first 36700160 bytes)
#   .fa4b/  cu13.tar.xz.part2, cu13.tar.xz.sha256, and these wheels (cp312, manylinux x86_64):
#           flash_attn_4-4.0.0b36, nvidia_cutlass_dsl-4.8.1, nvidia_cutlass_dsl_libs_base-4.8.1,
#           nvidia_cutlass_dsl_libs_core-4.8.1, quack_kernels-0.6.5, apache_tvm_ffi-0.1.15.post2,
#           torch_c_dlpack_ext-0.1.5
#   Their other needs (torch, einops, typing-extensions, cuda-bindings, protobuf, packaging) are
#   expected on the machine; nvidia-cutlass-dsl's hard need of -libs-cu12 is left out on purpose (the
#   cu13 flavour is the one that matches torch 2.11+cu130 and the 580 driver).
#   Rebuild (here, in the repo root):
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl flash-attn-4==4.0.0b36 \
#       nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
#       nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
#       torch-c-dlpack-ext==0.1.5
#     d=$(mktemp -d); (cd $d && unzip -q $OLDPWD/.whl/nvidia_cutlass_dsl_libs_cu13-*.whl && tar --owner=0 \
#       --group=0 --sort=name -cf - nvidia_cutlass_dsl nvidia_cutlass_dsl_libs_cu13-4.8.1.dist-info) \
#       | xz -9e -T1 > /tmp/cu13.tar.xz     # ~61.2 MB, ~4.5 min
#     mkdir -p .fa4a .fa4b; head -c 36700160 /tmp/cu13.tar.xz > .fa4a/cu13.tar.xz.part1
#     tail -c +36700161 /tmp/cu13.tar.xz > .fa4b/cu13.tar.xz.part2
#     (cd /tmp && sha256sum cu13.tar.xz) > .fa4b/cu13.tar.xz.sha256
#     cp .whl/*.whl .fa4b/ && rm .fa4b/nvidia_cutlass_dsl_libs_cu13-*.whl
#   (/.whl/, /.fa4a/ and /.fa4b/ are in .git/info/exclude.)
#
# Overrides, for trying it elsewhere: FA4_PYTHON (python3), FA4_SITE (/tmp/site),
# FA4_STASH (/root/fa4), FA4_PTH=0 (write no .pth file).

_fa4_part1() {
  local stash=${FA4_STASH:-/root/fa4} py=${FA4_PYTHON:-python3}
  [ -f .fa4a/cu13.tar.xz.part1 ] || { echo "fa4_setup: .fa4a/cu13.tar.xz.part1 missing (copy .fa4a/ to the machine)" >&2; return 1; }
  mkdir -p "$stash" && cp .fa4a/cu13.tar.xz.part1 "$stash/" || return 1
  echo "fa4_setup part1: $(stat -c %s "$stash/cu13.tar.xz.part1") bytes in $stash; part2 next"
  "$py" - <<'EOF'
import importlib.metadata as m
for name in ("torch", "einops", "typing-extensions", "cuda-bindings", "protobuf", "packaging",
             "flash-attn-4", "nvidia-cutlass-dsl"):
    try:
        print(f"  {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
  return 0
}

_fa4_part2() {
  local stash=${FA4_STASH:-/root/fa4} site=${FA4_SITE:-/tmp/site} py=${FA4_PYTHON:-python3}
  local part1=$stash/cu13.tar.xz.part1 sum pth
  [ -f "$part1" ] || part1=.fa4a/cu13.tar.xz.part1
  if [ ! -f "$part1" ]; then
    echo "fa4_setup: $stash/cu13.tar.xz.part1 missing: run part1 on this machine first" >&2
    return 1
  fi
  [ -f .fa4b/cu13.tar.xz.part2 ] || { echo "fa4_setup: .fa4b/cu13.tar.xz.part2 missing (copy .fa4b/ to the machine)" >&2; return 1; }
  # 1. The small wheels first: pip --target --upgrade replaces whole top-level folders.
  mkdir -p "$site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" .fa4b/*.whl || { echo "fa4_setup: pip install failed" >&2; return 1; }
  # 2. The cu13 library wheel's files, joined, checked, untarred over them.
  sum=$(cat "$part1" .fa4b/cu13.tar.xz.part2 | sha256sum | cut -d' ' -f1)
  if [ "$sum" != "$(cut -d' ' -f1 .fa4b/cu13.tar.xz.sha256)" ]; then
    echo "fa4_setup: joined tarball's sha256 $sum does not match .fa4b/cu13.tar.xz.sha256" >&2
    return 1
  fi
  if command -v xz >/dev/null; then
    cat "$part1" .fa4b/cu13.tar.xz.part2 | xz -dc | tar -x -C "$site" || { echo "fa4_setup: untar failed" >&2; return 1; }
  else
    cat "$part1" .fa4b/cu13.tar.xz.part2 | "$py" -c "import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')" "$site" \
      || { echo "fa4_setup: untar (python) failed" >&2; return 1; }
  fi
  # 3. The path, for this shell and (through a .pth) for scripts that reset PYTHONPATH.
  export PYTHONPATH="src:$site:$site/nvidia_cutlass_dsl/dsl_packages"
  echo "export PYTHONPATH=$PYTHONPATH"
  if [ "${FA4_PTH:-1}" != 0 ]; then
    pth=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/fa4_tmp_site.pth
    if printf '%s\n%s\n' "$site" "$site/nvidia_cutlass_dsl/dsl_packages" > "$pth" 2>/dev/null; then
      echo "fa4_setup: wrote $pth (so gpu_run.sh's PYTHONPATH=src still sees FA4)"
    else
      echo "fa4_setup: could not write $pth: run FA4 scripts with the PYTHONPATH above" >&2
    fi
  fi
  # 4. The import check.
  echo "python3 -c \"from flash_attn.cute import flash_attn_func\""
  "$py" -c "from flash_attn.cute import flash_attn_func; import importlib.metadata as m; print('fa4 import ok: flash-attn-4', m.version('flash-attn-4'), 'nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))" \
    || { echo "fa4_setup: import failed" >&2; return 1; }
  return 0
}

_fa4_check() {
  "${FA4_PYTHON:-python3}" - <<'EOF'
import time
import torch
import torch.nn.functional as F
from flash_attn.cute import flash_attn_func

q, k, v = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
t = time.perf_counter()
out = flash_attn_func(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
torch.cuda.synchronize()
ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
err = (out.float() - ref.float()).abs().max().item()
print(f"fa4 check: (2,1024,8,128) causal bf16 forward, first call {time.perf_counter() - t:.1f} s, max |fa4 - sdpa| {err:.4f}")
assert err < 0.05, err
EOF
}

_fa4_main() {
  local rc=0 step
  [ $# -gt 0 ] || { echo "usage: bash benchmarks/fa4_setup.sh part1 | source benchmarks/fa4_setup.sh part2 [check]" >&2; return 2; }
  for step in "$@"; do
    case $step in
      part1) _fa4_part1 || { rc=1; break; } ;;
      part2) _fa4_part2 || { rc=1; break; } ;;
      check) _fa4_check || { rc=1; break; } ;;
      *) echo "fa4_setup: unknown step $step" >&2; rc=2; break ;;
    esac
  done
  return $rc
}

_fa4_main "$@"
_fa4_rc=$?
unset -f _fa4_part1 _fa4_part2 _fa4_check _fa4_main
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  return $_fa4_rc
else
  exit $_fa4_rc
fi
