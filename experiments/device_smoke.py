"""The device check's first step: versions, devices, and one seconds-long step of every path.

Prints the versions of Python and every package the check uses, the devices, and then runs one
tiny training step of each path the later steps take, each on its own, so that an API that
changed under a newer JAX (the device image has jax 0.11) fails here in seconds rather than in a
later step's minutes:

    backprop bf16     one backprop step on each platform (the GPU's with cuDNN attention)
    ouroboros G=1     Ouroboros on one device (the GPU tests' comparison)
    ring G=2 (cpu)    Ouroboros streamed and ZB-V on two CPU devices: shard_map, ppermute, the
                      tables' executor and the default recipe (the cpu benches' code)
    layer pieces      the graph stash's forward and backward and one optimizer update (layer_costs)

Writes versions.json and smoke.csv (path, platform, seconds, status) into --out; exits 1 if any
path failed.

    python experiments/device_smoke.py --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import os
import platform
import sys
import time
import traceback

from ouroboros_jax.runtime import host

# XLA:CPU's quickest compile (the tests' setting, tests/conftest.py), where this XLA knows it.
if host.xla_knows_flag('--xla_backend_optimization_level'):
  os.environ['XLA_FLAGS'] = os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0'

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 2)  # before any backend starts: the CPU ring of G = 2

import numpy as np  # noqa: E402
import optax  # noqa: E402

from ouroboros_jax.models import model as transformer  # noqa: E402
from ouroboros_jax.models import partition  # noqa: E402
from ouroboros_jax.schedules import ScheduleConfig, build_schedule  # noqa: E402
from ouroboros_jax.schedules.compensation import Compensation  # noqa: E402

PACKAGES = (
  'jax',
  'jaxlib',
  'jax-cuda13-plugin',
  'jax-cuda12-plugin',
  'flax',
  'optax',
  'orbax-checkpoint',
  'chex',
  'numpy',
  'protobuf',
  'grain',
  'tensorflow-datasets',
  'array-record',
  'tensorboardX',
  'matplotlib',
)


def versions() -> dict:
  found = {'python': platform.python_version()}
  for name in PACKAGES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  found['devices'] = [f'{d.platform}:{d.device_kind}' for d in jax.devices()]
  found['cpu_devices'] = len(jax.devices('cpu'))
  found['cores'] = os.cpu_count()
  return found


def tiny(num_stages: int, dtype: str, attention: str = 'auto'):
  cfg = transformer.ModelConfig(
    d_model=32, num_heads=2, num_layers=num_stages, d_ff=64, seq_len=16, dtype=dtype,
    attention=attention,
  )  # fmt: skip
  layers = (1,) * num_stages
  params = partition.to_staged(transformer.init_params(cfg, jax.random.key(0)), layers)
  return cfg, partition.transformer_stages(cfg, layers), params


def train_steps(config: ScheduleConfig, devices, dtype='float32', attention='auto', steps=1):
  cfg, model, params = tiny(config.stage_groups, dtype, attention)
  schedule = build_schedule(config, model, optax.adam(1e-3), devices=devices)
  rng = np.random.default_rng(0)
  batch = {
    k: rng.integers(0, 256, (8, cfg.seq_len)).astype(np.int32) for k in ('inputs', 'targets')
  }
  state = schedule.init(params, batch)
  for _ in range(steps):
    state, metrics = schedule.step(state, batch)
  loss = float(metrics['loss'])
  if not np.isfinite(loss):
    raise FloatingPointError(f'loss {loss}')
  return loss


def layer_pieces(device):
  from ouroboros_jax.perf import timing
  from ouroboros_jax.schedules.stash import GraphStash
  from ouroboros_jax.update import GroupedOptimizer

  cfg, model, params = tiny(1, 'float32')
  params = jax.device_put(params, device)
  stash, key = GraphStash(model, 'all'), jax.random.key(0)  # the whole VJP, as bench's pieces
  layer = jax.tree.map(lambda a: a[0], params['stages'])
  x = jax.numpy.ones((2, cfg.seq_len, cfg.d_model), jax.numpy.float32)
  y, kept, _ = jax.jit(lambda p, h: stash.forward(p, h, 0, key))(layer, jax.device_put(x, device))
  jax.block_until_ready(jax.jit(lambda p, k, d: stash.backward(p, k, d, 0, key))(layer, kept, y))
  grouped = GroupedOptimizer(timing.bench_optimizer('muon'), clip_norm=1.0)
  grads = jax.tree.map(jax.numpy.ones_like, params)
  jax.block_until_ready(jax.jit(grouped.apply)(params, grouped.init(params), grads))
  return 0.0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='runs/device_smoke')
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  found = versions()
  print(json.dumps(found, indent=1))
  with open(os.path.join(args.out, 'versions.json'), 'w') as f:
    json.dump(found, f, indent=1)

  cpu = jax.devices('cpu')
  gpus = [d for d in jax.devices() if d.platform == 'gpu']
  recipe = Compensation(predict=True, dc_lambda=1.0)  # the default recipe's (RECIPE_COMPENSATION)
  paths = []
  for device in (gpus or cpu)[:1]:  # the one-device paths on the GPU (the CPU without one)
    kind = device.platform
    paths += [
      ('backprop bf16', kind,
        lambda d=device: train_steps(ScheduleConfig('backprop'), [d], 'bfloat16')),
      ('ouroboros G=1', kind,
        lambda d=device: train_steps(ScheduleConfig('ouroboros', num_stages=1), [d])),
      ('layer pieces', kind, lambda d=device: layer_pieces(d)),
    ]  # fmt: skip
  stream = ScheduleConfig(
    'ouroboros', num_stages=2, microbatches=2, flow='stream', forward='pipelined',
    compensation=recipe,
  )  # fmt: skip
  paths += [
    ('ring G=2 stream', 'cpu', lambda: train_steps(stream, cpu[:2], steps=1)),
    ('zb_v G=2', 'cpu',
      lambda: train_steps(ScheduleConfig('zb_v', num_stages=2, microbatches=2), cpu[:2])),
  ]  # fmt: skip

  rows, failed = [], 0
  for name, kind, run in paths:
    start = time.perf_counter()
    try:
      run()
      status = 'ok'
    except Exception as e:  # noqa: BLE001  (every path is tried; the failure is reported)
      status = f'FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'
      traceback.print_exc()
      failed += 1
    seconds = time.perf_counter() - start
    rows.append({'path': name, 'platform': kind, 'seconds': round(seconds, 2), 'status': status})
    print(f'smoke {name:18s} {kind:4s} {seconds:6.1f} s  {status}', flush=True)
  with open(os.path.join(args.out, 'smoke.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
