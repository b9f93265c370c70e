#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that the GPU machines' image lacks for
# `ouroboros train`: grain, tensorflow-datasets, array-record, tensorboardX, importlib-resources and
# the requirements of these that the image does not hold (/work/.library/device/KINDS.md, "Python
# packages already there"), for CPython 3.12 manylinux x86_64, at the versions the project venv uses
# (promise 2.3 has no wheel on PyPI: it is built here from its source archive, pure Python).
#
#   bash experiments/device_wheels.sh        # here, from the repository root, with network
#
# The device check names `.whl` in the run's `carry` and starts with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
# (no network there; the checkout itself goes on PYTHONPATH, not installed). Fails if the wheels
# are over 40 MiB, so that they and the working tree stay inside the 64 MiB that travels.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
  grain==0.2.18
  array-record==0.8.6
  tensorflow-datasets==4.9.10
  tensorboardX==2.6.5
  importlib-resources==7.1.0
  portpicker==1.6.0               # grain
  dm-tree==0.1.10                 # tensorflow-datasets
  immutabledict==4.3.1            # tensorflow-datasets
  simple-parsing==0.1.9           # tensorflow-datasets
  docstring-parser==0.18.0        # simple-parsing
  tensorflow-metadata==1.21.0     # tensorflow-datasets
  googleapis-common-protos==1.76.0  # tensorflow-metadata
  termcolor==3.3.0                # tensorflow-datasets
  toml==0.10.2                    # tensorflow-datasets
)

rm -rf .whl
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
# promise (tensorflow-datasets needs it) is published as a source archive only: build its wheel,
# pure Python (py3-none-any).
python3 -m pip wheel -q --no-deps --no-binary=promise -w .whl promise==2.3
WHEELS+=(promise==2.3)

ls -1 .whl
n=$(ls .whl/*.whl | wc -l)
bytes=$(cat .whl/*.whl | wc -c)
echo "$n wheels, $(awk -v b="$bytes" 'BEGIN { printf "%.2f", b / 1048576 }') MiB"
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels" >&2
  exit 1
fi
if [ "$bytes" -gt $((40 * 1048576)) ]; then
  echo "over 40 MiB" >&2
  exit 1
fi
