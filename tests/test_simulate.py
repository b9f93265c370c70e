"""The performance simulator against the closed forms it must reproduce.

`experiments/simulate.py` is a script, so it is loaded from its file.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import math
import pathlib
import random
import sys
import types

import pytest

from ouroboros_jax import costs as cost_model
from ouroboros_jax.choices import FORWARD_MODES
from ouroboros_jax.perf import cost_model as sim_costs
from ouroboros_jax.perf import simulate as sim
from ouroboros_jax.perf import task_graph
from ouroboros_jax.schedules import ScheduleConfig, tables

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str, path: pathlib.Path):
  if name not in sys.modules:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
  return sys.modules[name]


TOL = 1e-9  # float64 sums of O(1..100) simulated times: ~1e-14; a wrong bubble is O(0.1)


def _run(**fields):
  """A setting as the simulator takes it: resolved (on 'cpu', batches of 8 rows)."""
  return ScheduleConfig(**fields).resolve('cpu', 8)


def costs(forward, backward, **kwargs):
  return sim_costs.StageCosts(forward_s=forward, backward_s=backward, **kwargs)


def random_costs(rng: random.Random, num_stages: int, **kwargs):
  return costs(
    [rng.uniform(0.5, 2.0) for _ in range(num_stages)],
    [rng.uniform(1.0, 4.0) for _ in range(num_stages)],
    head_s=rng.uniform(0.0, 1.5),
    embed_forward_s=rng.uniform(0.0, 0.2),
    embed_backward_s=rng.uniform(0.0, 0.2),
    **kwargs,
  )


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize('num_stages', [2, 4, 8])
@pytest.mark.parametrize('microbatches', [1, 4, 8])
def test_gpipe_reproduces_the_analytic_bubble(num_stages, microbatches):
  G, M, F, B = num_stages, microbatches, 1.0, 2.0
  result = sim.simulate(_run(name='gpipe', microbatches=M), costs([F] * G, [B] * G))
  bubble = (G - 1) / (M + G - 1)
  assert result.idle_fraction == pytest.approx(bubble, abs=TOL)
  assert all(i == pytest.approx(bubble, abs=TOL) for i in result.per_device_idle)
  assert result.step_time == pytest.approx((M + G - 1) * (F + B) / M, abs=TOL)


@pytest.mark.parametrize('num_stages', [2, 3, 4, 8])
def test_locked_ouroboros_equal_stages(num_stages):
  G, F, B, H, Ef, Eb = num_stages, 1.0, 2.0, 0.5, 0.1, 0.25
  c = costs([F] * G, [B] * G, head_s=H, embed_forward_s=Ef, embed_backward_s=Eb)
  result = sim.simulate('ouroboros', c)
  assert result.step_time == pytest.approx(Ef + G * F + H + B + Eb, abs=TOL)
  # every device is busy for F + B of the step (device 0 also for the head and embedding)
  assert result.per_device_busy[1] == pytest.approx(F + B, abs=TOL)


@pytest.mark.parametrize('slow', [0, 1, 2])
def test_locked_ouroboros_with_one_slow_stage(slow):
  """Step = E_f + sum F + max(H + B_0 + E_b, max_{s>0} B_s): devices s > 0 start their backward
  as soon as the batch is back on device 0, without waiting for the head."""
  G, H, Eb = 4, 0.5, 0.25
  forward, backward = [1.0] * G, [2.0] * G
  forward[slow], backward[slow] = 3.0, 5.0
  result = sim.simulate('ouroboros', costs(forward, backward, head_s=H, embed_backward_s=Eb))
  expected = sum(forward) + max(H + backward[0] + Eb, max(backward[1:]))
  assert result.step_time == pytest.approx(expected, abs=TOL)
  if slow == 0:  # the paper's formula with the slow stage: G F + H + B_slow (+ E_b)
    assert result.step_time == pytest.approx(3.0 + 3 * 1.0 + H + 5.0 + Eb, abs=TOL)


@pytest.mark.parametrize('num_stages', [1, 2, 5])
def test_model_parallel_is_the_sum_of_everything(num_stages):
  c = random_costs(random.Random(num_stages), num_stages)
  result = sim.simulate('model_parallel', c)
  assert result.step_time == pytest.approx(c.total_compute_s(), abs=TOL)
  assert result.speedup == pytest.approx(1.0, abs=TOL)


@pytest.mark.parametrize('num_stages', [2, 3, 6])
def test_pipelined_ouroboros_is_the_busiest_device(num_stages):
  c = random_costs(random.Random(10 + num_stages), num_stages)
  result = sim.simulate(_run(name='ouroboros', forward='pipelined'), c)
  device0 = c.embed_forward_s + c.forward_s[0] + c.head_s + c.backward_s[0] + c.embed_backward_s
  others = [f + b for f, b in zip(c.forward_s[1:], c.backward_s[1:])]
  assert result.step_time == pytest.approx(max(device0, *others), abs=TOL)
  # Hops that fit inside a step are hidden: only what reads them waits, a step later.
  hops = dataclasses.replace(c, latency=0.1, activation_bytes=1e6, bandwidth=1e8)
  linked = sim.simulate(_run(name='ouroboros', forward='pipelined'), hops)
  assert linked.step_time == pytest.approx(result.step_time, abs=TOL)


def test_pipelined_equal_stages_reach_the_g_fold_speedup():
  G = 8
  result = sim.simulate(_run(name='ouroboros', forward='pipelined'), costs([1.0] * G, [2.0] * G))
  assert result.step_time == pytest.approx(3.0, abs=TOL)
  assert result.speedup == pytest.approx(G, abs=TOL)
  assert result.idle_fraction == pytest.approx(0.0, abs=TOL)


@pytest.mark.parametrize('forward', ['locked', 'pipelined'])
def test_replay_adds_the_forward_to_every_backward(forward):
  c = random_costs(random.Random(3), 4)
  replay = sim.simulate(_run(name='ouroboros', forward=forward, stash='replay'), c)
  recompute = dataclasses.replace(c, backward_s=[f + b for f, b in zip(c.forward_s, c.backward_s)])
  graph = sim.simulate(_run(name='ouroboros', forward=forward, stash='graph'), recompute)
  assert replay.step_time == pytest.approx(graph.step_time, abs=TOL)
  assert replay.step_time > sim.simulate(_run(name='ouroboros', forward=forward), c).step_time


def test_link_latency_adds_g_hops_to_the_locked_forward():
  G, hop = 4, 0.05
  c = costs([1.0] * G, [2.0] * G, head_s=0.5)
  free = sim.simulate('ouroboros', c).step_time
  linked = dataclasses.replace(c, latency=0.03, activation_bytes=2e6, bandwidth=1e8)
  assert linked.transfer_s(linked.activation_bytes) == pytest.approx(hop)
  assert sim.simulate('ouroboros', linked).step_time == pytest.approx(free + G * hop, abs=TOL)
  # model_parallel pays G hops forward and G back (the head's delta to G-1 included)
  assert sim.simulate('model_parallel', linked).step_time == pytest.approx(
    c.total_compute_s() + 2 * G * hop, abs=TOL
  )


@pytest.mark.parametrize('replicas', [1, 2, 4, 8])
def test_data_parallel_all_reduce(replicas):
  D, grad_bytes, bandwidth, latency = replicas, 4e9, 1e11, 1e-5
  c = random_costs(
    random.Random(replicas), 3, grad_bytes=grad_bytes, bandwidth=bandwidth, latency=latency
  )
  result = sim.simulate(_run(name='data_parallel', data_parallel=D), c)
  all_reduce = 2 * (D - 1) / D * grad_bytes / bandwidth + 2 * (D - 1) * latency
  assert result.step_time == pytest.approx(c.total_compute_s() / D + all_reduce, abs=TOL)
  assert result.num_devices == D
  # float32 gradients of parameters counted at bfloat16's width: twice the bytes to reduce
  wide = sim.simulate(
    _run(name='data_parallel', data_parallel=D), dataclasses.replace(c, reduce_scale=2)
  )
  wide_reduce = all_reduce + 2 * (D - 1) / D * grad_bytes / bandwidth
  assert wide.step_time == pytest.approx(c.total_compute_s() / D + wide_reduce, abs=TOL)
  measured = dataclasses.replace(c, allreduce_s=0.5)
  expected = c.total_compute_s() / D + (0.5 if D > 1 else 0.0)
  assert sim.simulate(
    _run(name='data_parallel', data_parallel=D), measured
  ).step_time == pytest.approx(expected, abs=TOL)


def test_one_device_is_backprop_for_every_schedule():
  c = random_costs(random.Random(0), 1, latency=0.01, activation_bytes=1.0, bandwidth=10.0)
  expected = c.total_compute_s()
  for schedule, kwargs in [
    ('backprop', {}),
    ('model_parallel', {}),
    ('gpipe', {'microbatches': 4}),
    ('ouroboros', {}),
    ('ouroboros', {'forward': 'pipelined'}),
    ('ouroboros', {'microbatches': 4}),  # micro-batch by micro-batch: the same sum
    ('data_parallel', {}),
  ]:
    assert sim.simulate(_run(name=schedule, **kwargs), c).step_time == pytest.approx(
      expected, abs=TOL
    ), (schedule, kwargs)


def test_the_idle_fractions_the_schedules_advertise():
  """schedules.py / ouroboros.py state these for equal stages, B = 2F, no head or links."""
  for G in (2, 4, 8):
    c = costs([1.0] * G, [2.0] * G)
    assert sim.simulate('model_parallel', c).idle_fraction == pytest.approx((G - 1) / G)
    assert sim.simulate('ouroboros', c).idle_fraction == pytest.approx((G - 1) / (G + 2))
    assert sim.simulate(
      _run(name='data_parallel', data_parallel=G), c
    ).idle_fraction == pytest.approx(0)


def test_the_simulator_needs_only_the_standard_library():
  """simulate.py and the package modules it imports (the delays, cost_model.py) use the standard
  library only at import time (a function may import JAX when it is called)."""
  todo, seen = ['perf.simulate'], set()
  while todo:
    name = todo.pop()
    seen.add(name)
    tree = ast.parse((ROOT / 'ouroboros_jax' / f'{name.replace(".", "/")}.py').read_text())
    imported = {
      alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
      node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
    }
    imported |= {  # `from PACKAGE import module`
      f'{node.module}.{alias.name}'
      for node in tree.body
      if isinstance(node, ast.ImportFrom)
      and node.module
      and node.module.startswith('ouroboros_jax')
      and (ROOT / node.module.replace('.', '/')).is_dir()
      for alias in node.names
    }
    imported = {m for m in imported if not (ROOT / m.replace('.', '/')).is_dir()}
    own = {m.split('.', 1)[1] for m in imported if m.startswith('ouroboros_jax.')}
    others = {m.split('.')[0] for m in imported if not m.startswith('ouroboros_jax')}
    assert others <= set(sys.stdlib_module_names) | {'__future__'}, (name, others)
    todo += sorted(own - seen)
  assert seen == {
    'perf.simulate',
    'perf.task_graph',
    'perf.cost_model',
    'schedules.delays',
    'schedules.tables',
    'choices',
    'costs',
    'errors',
  }


# ----------------------------------------------------------------------------- invariants


ALL_SETTINGS = [
  ('backprop', {}),
  ('model_parallel', {}),
  ('gpipe', {'microbatches': 1}),
  ('gpipe', {'microbatches': 4}),
  ('ouroboros', {}),
  ('ouroboros', {'stash': 'replay'}),
  ('ouroboros', {'forward': 'pipelined'}),
  ('ouroboros', {'forward': 'pipelined', 'stash': 'replay'}),
]


@pytest.mark.parametrize('num_stages', [1, 2, 4, 7])
def test_no_schedule_beats_the_physical_limit(num_stages):
  rng = random.Random(100 + num_stages)
  for trial in range(3):
    c = random_costs(
      rng,
      num_stages,
      latency=rng.choice([0.0, 1e-3]),
      activation_bytes=1e6,
      bandwidth=rng.choice([math.inf, 1e9]),
      grad_bytes=1e8,
      microbatch_overhead_s=rng.choice([0.0, 0.01]),
    )
    for schedule, kwargs in ALL_SETTINGS + [('data_parallel', {'data_parallel': num_stages})]:
      result = sim.simulate(_run(name=schedule, **kwargs), c)
      assert result.speedup <= result.num_devices + TOL, (schedule, kwargs, result.speedup)
      assert all(-TOL <= i <= 1 + TOL for i in result.per_device_idle)


@pytest.mark.parametrize(
  'schedule,kwargs', ALL_SETTINGS + [('data_parallel', {'data_parallel': 3})]
)
def test_timeline_never_overlaps_on_a_device_or_a_link(schedule, kwargs):
  c = random_costs(
    random.Random(7), 3, latency=0.05, activation_bytes=1e6, bandwidth=1e7, grad_bytes=1e6
  )
  result = sim.simulate(_run(name=schedule, **kwargs), c)
  lanes = {}
  for span in result.timeline:
    assert span.end >= span.start >= 0
    lanes.setdefault(span.device, []).append((span.start, span.end))
  assert set(range(result.num_devices)) <= set(lanes)
  for spans in lanes.values():
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
      assert start >= end - TOL


def test_timeline_kinds_and_batches():
  G = 3
  result = sim.simulate('ouroboros', costs([1.0] * G, [2.0] * G), steps=20)
  kinds = {s.kind for s in result.timeline}
  assert {'fwd', 'bwd', 'head', 'embed_fwd', 'embed_bwd', 'act', 'grad'} <= kinds
  # locked: stage s back-propagates batch t - (G - s), so device 2 never sees batch 19 backward
  backward = {(s.device, s.batch) for s in result.timeline if s.kind == 'bwd'}
  assert (2, 18) in backward and (2, 19) not in backward
  assert (0, 16) in backward and (0, 17) not in backward
  assert len(result.step_ends) == 20


def test_bad_settings_are_refused():
  c = costs([1.0, 1.0], [2.0, 2.0], batch_size=6)
  with pytest.raises(ValueError, match='unknown schedule'):
    sim.simulate('pipedream', c)
  with pytest.raises(ValueError, match='stash'):
    sim.simulate(_run(name='ouroboros', stash='none'), c)
  with pytest.raises(ValueError, match='forward'):
    sim.simulate(_run(name='ouroboros', forward='eager'), c)
  with pytest.raises(ValueError, match='microbatches=4'):
    sim.simulate(_run(name='gpipe', microbatches=4), c)
  with pytest.raises(ValueError, match='param_bytes'):
    sim.simulate(_run(name='gpipe', data_parallel=2), c)
  with pytest.raises(ValueError, match='num_stages=4 but the costs have 2 stages'):
    sim.simulate(_run(name='model_parallel', num_stages=4), c)


def test_a_schedule_config_s_own_defaults_are_simulated():
  """The simulator reads a ScheduleConfig's micro-batches (`num_microbatches`: the pipelines cut
  the batch, Ouroboros takes it whole unless told) rather than a rule of its own."""
  c = costs([1.0] * 2, [2.0] * 2)
  for name in ('gpipe', '1f1b', 'ouroboros'):
    default = _run(name=name, num_stages=2)
    given = _run(name=name, num_stages=2, microbatches=default.microbatches)
    assert sim.simulate(default, c).step_time == sim.simulate(given, c).step_time
    assert sim.simulate(name, c).step_time == sim.simulate(_run(name=name), c).step_time
  with pytest.raises(ValueError, match='one entry per stage'):
    costs([1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------- cost model


def test_transformer_costs_from_flops():
  L, d, f, seq, V, batch, G = 4, 64, 256, 32, 100, 2, 2
  c = sim_costs.transformer_costs(
    sim_costs.ModelShape('test', L, d, f, seq, V, batch),
    sim_costs.Hardware('test', flops_per_s=1e9, bandwidth=1e9, latency=0.0),
    G,
    layers_per_stage=(1, 3),
    bytes_per_value=4,
  )
  tokens = batch * seq
  layer = (2 * (4 * d * d + 2 * d * f) + 2 * seq * d) * tokens / 1e9
  assert c.forward_s == pytest.approx((layer, 3 * layer))
  assert c.backward_s == pytest.approx((2 * layer, 6 * layer))
  assert c.head_s == pytest.approx(3 * (2 * d * V + 5 * V + 2 * d) * tokens / 1e9)
  assert c.activation_bytes == tokens * d * 4
  assert c.grad_bytes == (L * (4 * d * d + 2 * d * f) + V * d) * 4
  assert c.reduce_scale == 1.0  # float32 weights computed in float32
  bf16 = sim_costs.transformer_costs(
    sim_costs.ModelShape('test', L, d, f, seq, V, batch), sim_costs.NVLINK, G, bytes_per_value=2
  )  # float32 weights gathered in bfloat16, their gradients reduced in float32
  assert bf16.reduce_scale == 2.0 and bf16.grad_bytes == c.grad_bytes / 2


@pytest.mark.parametrize('rows, cols', [(16, 48), (32, 32), (64, 16)])
def test_newton_schulz_flops_are_optax_muons(rows, cols):
  """The simulator's price of Muon's orthogonalisation counts the matrix products of
  optax.contrib.muon's own Newton-Schulz iteration, read off its jaxpr, for wide, square and
  tall matrices."""
  import jax.numpy as jnp
  from optax.contrib import _muon

  coeffs = jnp.array((3.4445, -4.7750, 2.0315))  # optax.contrib.muon's ns_coeffs
  traced = cost_model.matmul_flops(
    lambda x: _muon.orthogonalize_via_newton_schulz(x, coeffs), jnp.ones((rows, cols))
  )
  assert cost_model.newton_schulz_flops(rows, cols) == traced


def test_transformer_costs_price_each_stages_optimizer_update():
  """Each stage's update: its layers' orthogonalisation (Muon's four kernels a layer) at the
  matmul rate plus the elementwise pass over its parameters at the memory rate; stage 0 also
  updates the embedding (elementwise). AdamW pays only the pass; no optimizer, nothing."""
  L, d, f, V = 4, 64, 256, 100
  shape = sim_costs.ModelShape('test', L, d, f, 32, V, 2)
  rates = sim_costs.Hardware('test', flops_per_s=1e9, bandwidth=1e9, latency=0.0)
  rates = dataclasses.replace(rates, memory_bandwidth=1e8)
  costs_of = lambda opt: sim_costs.transformer_costs(shape, rates, 2, (1, 3), optimizer=opt)
  moved = 7 * 4 / 1e8  # seconds a float32 parameter: Adam's 7 values read and written
  layer_params, embed = 4 * d * d + 2 * d * f, V * d
  ns = sum(cost_model.newton_schulz_flops(*m) for m in ((d, 3 * d), (d, d), (d, f), (f, d)))
  layer = ns / 1e9 + layer_params * moved
  assert costs_of('muon').update_s == pytest.approx((layer + embed * moved, 3 * layer))
  adam = (layer_params * moved + embed * moved, 3 * layer_params * moved)
  assert costs_of('adamw').update_s == pytest.approx(adam)
  assert costs_of(None).update_s == ()


def test_balanced_split_gives_device_0_fewer_layers_and_stops_at_the_layer_count():
  c = sim_costs.transformer_costs(sim_costs.GPT2_SMALL, sim_costs.NVLINK, 4)
  per_layer = cost_model.layer_flops(768, 3072, 1024) * 32 * 1024 / sim_costs.NVLINK.flops_per_s
  layers = [f / per_layer for f in c.forward_s]
  assert all(n == pytest.approx(round(n)) for n in layers) and sum(layers) == pytest.approx(12)
  assert layers[0] < min(layers[1:])  # device 0 also carries the head
  with pytest.raises(ValueError, match='num_stages=16 cuts the model into 16 groups'):
    sim_costs.transformer_costs(sim_costs.GPT2_SMALL, sim_costs.NVLINK, 16)
  assert sim_costs.GPT2_SMALL.params == pytest.approx(124e6, rel=0.05)
  assert 1e9 < sim_costs.ONE_B.params < 1.5e9


# ----------------------------------------------------------------------------- the experiment


@pytest.fixture
def experiment(monkeypatch):
  """experiments/simulate.py, whose `from ouroboros_jax import simulate` gets the module above
  without running the package's __init__ (which imports jax)."""
  if 'ouroboros_jax' not in sys.modules:
    package = types.ModuleType('ouroboros_jax')
    package.__path__ = [str(ROOT / 'ouroboros_jax')]
    package.simulate = sim
    monkeypatch.setitem(sys.modules, 'ouroboros_jax', package)
  monkeypatch.delitem(sys.modules, 'simulate_experiment', raising=False)
  return _load('simulate_experiment', ROOT / 'experiments' / 'simulate.py')


MEASURED = """\
schedule,stages,microbatches,stash,forward,step_time_s,fwd_s_per_stage,bwd_s_per_stage,head_s,link_s
backprop,1,,-,-,0.0125,0.001;0.002;0.003;0.004,0.002;0.004;0.006;0.008,0.0025,
model_parallel,4,,-,-,0.0129,0.001;0.002;0.003;0.004,0.002;0.004;0.006;0.008,0.0025,0.00005
gpipe,4,4,-,-,0.0080,0.0025,0.005,0.0025,0.0002
ouroboros,4,,graph,locked,0.0200,0.0025,0.005,0.0025,0
ouroboros,2,,replay,pipelined,0.0060,0.002;0.003,0.004;0.006,0.001,0.0001
data_parallel,2,,,,0.0070,0.004;0.006,0.008;0.012,0.0,
"""


def test_measured_option_compares_with_the_simulator(experiment, tmp_path, capsys):
  path = tmp_path / 'bench.csv'
  path.write_text(MEASURED)
  rows = experiment.main(['--measured', str(path), '--out', str(tmp_path / 'out')])
  assert [r['schedule'] for r in rows] == [
    'backprop',
    'model_parallel',
    'gpipe',
    'ouroboros',
    'ouroboros',
    'data_parallel',
  ]
  backprop, model_parallel, gpipe, locked, pipelined, data_parallel = rows
  assert backprop['predicted_s'] == pytest.approx(0.0325)
  assert model_parallel['predicted_s'] == pytest.approx(0.0325 + 8 * 0.00005)
  # gpipe: (M + G - 1) micro-batch rounds of (F + B) / M, the head, and 2 (M + G - 1) hops of
  # link_s / M, except that the micro-batches' hops overlap with the compute
  assert gpipe['predicted_s'] > 7 * 0.0075 / 4 + 0.0025
  assert locked['predicted_s'] == pytest.approx(4 * 0.0025 + 0.0025 + 0.005)
  assert locked['rel_error'] == pytest.approx(0.0175 / 0.0200 - 1)
  assert pipelined['predicted_s'] == pytest.approx(
    max(0.002 + 0.001 + 0.004 + 0.002, 0.003 + 0.006 + 0.003)
  )
  assert pipelined['stash'] == 'replay' and pipelined['forward'] == 'pipelined'
  assert data_parallel['predicted_s'] == pytest.approx(0.015)
  printed = capsys.readouterr().out
  assert 'measured ms' in printed and '-12.5%' in printed
  assert (tmp_path / 'out' / 'measured_vs_predicted.csv').read_text().count('\n') == 7


def test_measured_rows_need_one_time_per_stage(experiment, tmp_path):
  path = tmp_path / 'bad.csv'
  path.write_text(MEASURED.splitlines()[0] + '\nouroboros,4,,graph,locked,1,1;2,1,0,0\n')
  with pytest.raises(ValueError, match='needs 4 per-stage times'):
    experiment.main(['--measured', str(path), '--out', str(tmp_path)])


def test_prediction_table_and_csv(experiment, tmp_path, capsys):
  rows = experiment.main(
    [
      '--stages',
      '1,2,4,16',
      '--models',
      'gpt2-small',
      '--hardware',
      'nvlink-300GBps',
      '--no-plot',
      '--out',
      str(tmp_path),
    ]
  )
  printed = capsys.readouterr().out
  assert 'G = 16 not predicted' in printed and 'ouroboros pipelined' in printed
  assert {r['devices'] for r in rows} == {1, 2, 4}
  assert all(r['speedup'] <= r['devices'] + TOL for r in rows)
  by = {(r['label'], r['devices']): r['speedup'] for r in rows}
  assert by['ouroboros pipelined', 4] > by['ouroboros locked', 4] > by['model_parallel', 4]
  assert (tmp_path / 'simulate.csv').read_text().startswith('model,hardware,label')


@pytest.mark.parametrize(
  'name, chunks', [('1f1b', 1), ('interleaved', 2), ('zb_h1', 1), ('zb_v', 2)]
)
@pytest.mark.parametrize('num_stages, microbatches', [(2, 4), (4, 8), (4, 12)])
def test_the_exact_pipelines_run_from_their_tables(name, chunks, num_stages, microbatches):
  """The simulator reads the same tables: with F = 1, B = W = 1 per stage and free transfers its
  idle time is the table's bubble, idle / (idle + busy)."""
  table = tables.place(tables.build(name, num_stages, microbatches, chunks))
  bubble = tables.bubble(table)
  result = sim.simulate(
    _run(name=name, microbatches=microbatches, chunks=chunks),
    costs([1.0] * num_stages, [2.0] * num_stages),
  )
  assert result.idle_fraction == pytest.approx(bubble / (1 + bubble), abs=TOL)
  assert result.step_time == pytest.approx(3 * (1 + bubble), abs=TOL)


def test_zero_bubble_beats_1f1b_which_matches_gpipe_in_time():
  c = costs([1.0] * 4, [2.0] * 4, latency=0.01)
  step = {
    name: sim.simulate(_run(name=name, microbatches=8), c).step_time for name in ('gpipe', '1f1b')
  }
  step['zb_h1'] = sim.simulate(_run(name='zb_h1', microbatches=8), c).step_time
  assert step['zb_h1'] < step['1f1b']
  assert step['1f1b'] == pytest.approx(step['gpipe'], rel=0.05)


def test_zb_v_beats_zb_h1_on_free_links_but_pays_for_its_longer_chain_of_hops():
  """ZB-V's half-stage chunks halve ZB-H1's bubble when transfers are free; its V sends a
  micro-batch over 2p - 2 hops each way instead of p - 1, so latency eats the gain."""
  step = lambda name, latency: (
    sim.simulate(
      _run(name=name, microbatches=8), costs([1.0] * 4, [2.0] * 4, latency=latency)
    ).step_time
  )
  assert step('zb_v', 0.0) < step('zb_h1', 0.0) < step('1f1b', 0.0)
  assert step('zb_v', 0.05) > step('zb_h1', 0.05)


# ----------------------------------------------------------------------------- micro-batch costs


def test_measured_microbatch_costs_replace_perfect_scaling():
  """A micro-batch of B / 4 rows measured at 0.4 of the batch (not 0.25): GPipe's step is
  (M + G - 1) rounds of one micro-batch's f + b, the streamed ring's M of them per device."""
  G, M, F, B, f, b = 2, 4, 1.0, 2.0, 0.4, 0.8
  perfect = costs([F] * G, [B] * G)
  measured = dataclasses.replace(
    perfect, microbatch_forward_s={M: [f] * G}, microbatch_backward_s={M: [b] * G}
  )
  gpipe = lambda c, m=M: sim.simulate(_run(name='gpipe', microbatches=m), c).step_time
  assert gpipe(perfect) == pytest.approx((M + G - 1) * (F + B) / M, abs=TOL)
  assert gpipe(measured) == pytest.approx((M + G - 1) * (f + b), abs=TOL)  # 6.0, not 3.75
  assert gpipe(measured, 2) == pytest.approx(gpipe(perfect, 2), abs=TOL)  # M = 2 not measured
  stream = lambda forward: (
    sim.simulate(_run(name='ouroboros', microbatches=M, forward=forward), measured).step_time
  )
  assert stream('pipelined') == pytest.approx(M * (f + b), abs=TOL)
  assert stream('locked') == pytest.approx((M + G - 1) * f + M * b, abs=TOL)
  replay = sim.simulate(_run(name='ouroboros', microbatches=M, stash='replay'), measured)
  assert replay.step_time == pytest.approx((M + G - 1) * f + M * (f + b), abs=TOL)
  zb = sim.simulate(_run(name='zb_h1', microbatches=M), measured).per_device_busy
  assert zb == pytest.approx([M * (f + b)] * G, abs=TOL)  # B and W: half the measured b each
  # data_parallel's replicas each compute B / D rows: the micro-batch cost at M = D
  halves = dataclasses.replace(
    perfect, microbatch_forward_s={2: [0.6] * G}, microbatch_backward_s={2: [1.1] * G}
  )
  dp = sim.simulate(_run(name='data_parallel', data_parallel=2), halves)
  assert dp.step_time == pytest.approx(G * (0.6 + 1.1), abs=TOL)
  with pytest.raises(ValueError, match=r'microbatch_forward_s\[4\] needs'):
    dataclasses.replace(perfect, microbatch_forward_s={4: [f]})
  with pytest.raises(ValueError, match=r'microbatch_backward_s\[1\] needs M >= 2'):
    dataclasses.replace(perfect, microbatch_backward_s={1: [b] * G})


def test_one_device_micro_batched_ring_sums_its_micro_batches():
  """Ouroboros on one device cutting the batch into M: M times a micro-batch's forward, head and
  backward, then the update (its measured micro-batch costs, not the whole batch's)."""
  M, f, b = 4, 0.4, 0.8
  c = costs(
    [1.0],
    [2.0],
    head_s=0.2,
    update_s=[0.3],
    microbatch_forward_s={M: [f]},
    microbatch_backward_s={M: [b]},
  )
  for forward in FORWARD_MODES:
    ring = _run(name='ouroboros', microbatches=M, forward=forward)
    assert sim.simulate(ring, c).step_time == pytest.approx(M * (f + b) + 0.2 + 0.3, abs=TOL)
    replay = dataclasses.replace(ring, stash='replay')  # the backward re-runs the forward
    assert sim.simulate(replay, c).step_time == pytest.approx(M * (2 * f + b) + 0.5, abs=TOL)


@pytest.mark.parametrize(
  'name, kwargs',
  [
    ('model_parallel', {}),
    ('gpipe', {'microbatches': 4}),
    ('1f1b', {'microbatches': 4}),
    ('interleaved', {'microbatches': 4}),
    ('zb_h1', {'microbatches': 4}),
    ('zb_v', {'microbatches': 4}),
    ('ouroboros', {}),
    ('ouroboros', {'forward': 'pipelined', 'microbatches': 4}),
  ],
)
def test_program_scale_is_the_one_device_step_over_its_pieces(name, kwargs):
  """A setting's one-device step measured k times its pieces' one-device step gives k, and its
  G-device prediction with every compute time scaled by k (links free) is k times the unscaled
  one, lockstep ticks and devices slowing each other included."""
  G, k = 2, 1.37
  c = dataclasses.replace(
    random_costs(random.Random(3), G, update_s=[0.3, 0.2]),
    microbatch_forward_s={4: [0.6, 0.5]},
    microbatch_backward_s={4: [1.1, 0.9]},
    concurrent_slowdown=1.2,
  )
  run = _run(name=name, num_stages=G, **kwargs)
  one = sim_costs.first_stage(c)
  assert one.num_stages == 1 and one.concurrent_slowdown == 1.0
  assert one.microbatch_forward_s == {4: (0.6,)} and one.update_s == (0.3,)
  alone = sim.simulate(dataclasses.replace(run, num_stages=1), one, lockstep=True).step_time
  assert alone == pytest.approx(
    one.total_compute_s()
    if not kwargs.get('microbatches')
    else 4 * (0.6 + 1.1) + one.head_s + one.embed_forward_s + one.embed_backward_s + 0.3,
    abs=TOL,
  )
  assert sim.program_scale(run, c, k * alone) == pytest.approx(k, rel=1e-12)
  base = sim.simulate(run, c, lockstep=True).step_time
  assert sim.simulate(run, sim_costs.scaled(c, k), lockstep=True).step_time == pytest.approx(
    k * base, rel=1e-9
  )
  assert sim_costs.scaled(c, k).head_s == pytest.approx(k * c.head_s)
  assert sim_costs.scaled(c, k).microbatch_backward_s[4] == pytest.approx((k * 1.1, k * 0.9))


def measured_csv(path, extra_columns: str, *rows: str):
  """A measured CSV at `path`: MEASURED's columns plus `extra_columns`, and `rows`."""
  path.write_text('\n'.join([MEASURED.splitlines()[0] + extra_columns, *rows]) + '\n')
  return path


def test_measured_csv_reads_the_microbatch_columns(experiment, tmp_path):
  path = measured_csv(
    tmp_path / 'micro.csv',
    ',fwd_s_per_stage_micro,bwd_s_per_stage_micro',
    'gpipe,2,4,-,-,0.01,0.002,0.004,0,0,0.0008,0.0016',
    'gpipe,2,4,-,-,0.01,0.002,0.004,0,0,,',
    'data_parallel,2,,,,0.01,0.002;0.002,0.004;0.004,0,,0.0012;0.0012,0.0024;0.0024',
  )
  micro, perfect, dp = experiment.main(['--measured', str(path), '--out', str(tmp_path / 'o')])
  assert micro['predicted_s'] == pytest.approx(5 * (0.0008 + 0.0016))
  assert perfect['predicted_s'] == pytest.approx(5 * (0.002 + 0.004) / 4)
  assert dp['predicted_s'] == pytest.approx(0.0024 + 0.0048)


def test_measured_csv_scales_the_pieces_by_the_one_device_program(experiment, tmp_path):
  """A row whose one_device_s is twice what its pieces give one device is predicted twice as
  slow (links free), and the table shows the scale; a row without it keeps its pieces."""
  # gpipe M=4 on one device from these pieces: 4 x (0.0025 + 0.005) / 4 + 0.0025 = 0.01
  path = measured_csv(
    tmp_path / 'scaled.csv',
    ',one_device_s',
    'gpipe,2,4,-,-,0.02,0.0025,0.005,0.0025,0,0.02',
    'gpipe,2,4,-,-,0.02,0.0025,0.005,0.0025,0,',
  )
  scaled, plain = experiment.compare_measured(str(path))
  assert math.isnan(plain['program_scale']) and plain['predicted_s'] > 0.01
  assert scaled['program_scale'] == pytest.approx(2.0)
  assert scaled['predicted_s'] == pytest.approx(2 * plain['predicted_s'])
  table = experiment.format_comparison([scaled, plain]).splitlines()
  assert table[2].endswith('| 2.00') and table[3].endswith('| ')


def test_measured_csv_reads_a_zero_bubble_row_s_input_grad_share(experiment, tmp_path):
  """A ZB-H1 row with B at 0.7 of its backward is predicted slower than the same row read as an
  even split (its lockstep ticks wait for the longer B); an old CSV without the column reads as
  an even split."""
  path = measured_csv(
    tmp_path / 'split.csv',
    ',input_grad_share',
    'zb_h1,2,4,-,-,0.02,0.0025,0.005,0.0025,0,0.7',
    'zb_h1,2,4,-,-,0.02,0.0025,0.005,0.0025,0,',
  )
  skewed, even = experiment.compare_measured(str(path))
  old = measured_csv(tmp_path / 'old.csv', '', 'zb_h1,2,4,-,-,0.02,0.0025,0.005,0.0025,0')
  (before,) = experiment.compare_measured(str(old))
  assert even['predicted_s'] == pytest.approx(before['predicted_s'])
  assert skewed['predicted_s'] > even['predicted_s'] * 1.05


# ----------------------------------------------------------------------------- shared devices


@pytest.mark.parametrize('num_stages', [2, 3])
def test_shared_execution_at_no_slowdown_is_the_one_pass_execution(num_stages):
  """The event loop of `concurrent_slowdown` gives the one-pass schedule when nothing slows."""
  c = random_costs(
    random.Random(num_stages), num_stages, latency=0.01, activation_bytes=1e6, bandwidth=1e8
  )
  c = dataclasses.replace(c, update_s=[0.2] * num_stages)
  for schedule, kwargs in ALL_SETTINGS + [
    ('data_parallel', {'data_parallel': num_stages}),
    ('zb_h1', {'microbatches': 4, 'lockstep': True}),
    ('1f1b', {'microbatches': 4}),
    ('ouroboros', {'microbatches': 4, 'forward': 'pipelined'}),
  ]:
    fields = {k: v for k, v in kwargs.items() if k != 'lockstep'}
    tasks = sim.task_graph(
      _run(name=schedule, **fields), c, steps=8, lockstep=kwargs.get('lockstep', False)
    ).tasks
    one_pass = [t for span in sim.execute(tasks) for t in span]
    shared = [t for span in task_graph._execute_shared(tasks, 1.0) for t in span]
    assert shared == pytest.approx(one_pass, abs=TOL), (schedule, kwargs)


def test_concurrent_slowdown_slows_only_what_runs_beside_another_device():
  """F = 1, B = 2 on G = 2 devices that run 1.5x slower while both compute: the pipelined ring
  always computes on both, the locked forward on one at a time, model_parallel never on two."""
  c = costs([1.0] * 2, [2.0] * 2, concurrent_slowdown=1.5)
  step = lambda **kwargs: sim.simulate(_run(**kwargs), c).step_time
  assert step(name='ouroboros', forward='pipelined') == pytest.approx(1.5 * 3.0, abs=TOL)
  assert step(name='ouroboros') == pytest.approx(2 * 1.0 + 1.5 * 2.0, abs=TOL)
  assert step(name='model_parallel') == pytest.approx(6.0, abs=TOL)
  assert step(name='data_parallel', data_parallel=2) == pytest.approx(1.5 * 3.0, abs=TOL)
  assert step(name='backprop') == pytest.approx(6.0, abs=TOL)
  # one device alone for part of a task: GPipe M = 2 with the head on the last device
  half = sim.simulate(_run(name='gpipe', microbatches=2), dataclasses.replace(c, head_s=1.0))
  assert (
    half.step_time
    > sim.simulate(
      _run(name='gpipe', microbatches=2), costs([1.0] * 2, [2.0] * 2, head_s=1.0)
    ).step_time
  )
  with pytest.raises(ValueError, match='concurrent_slowdown'):
    costs([1.0], [1.0], concurrent_slowdown=0.0)


def test_lockstep_ticks_make_1f1b_wait_for_the_slower_operation_of_each_tick():
  """In lockstep (every tick ends with a ppermute) a tick lasts as long as its slowest operation:
  1F1B's forward (1/M) beside a fused backward (2/M) loses time that GPipe, whose ticks are all
  forwards then all backwards, does not; ZB's B and W are halves, as long as its F."""
  c = costs([1.0] * 2, [2.0] * 2)
  step = lambda name, lockstep: (
    sim.simulate(_run(name=name, microbatches=4), c, lockstep=lockstep).step_time
  )
  assert step('gpipe', True) == pytest.approx(step('gpipe', False), abs=TOL)
  assert step('zb_h1', True) == pytest.approx(step('zb_h1', False), abs=TOL)
  assert step('1f1b', False) == pytest.approx(step('gpipe', False), abs=TOL)
  assert step('1f1b', True) > step('gpipe', True) + 0.5
  # every tick's hop is on the critical path in lockstep, even an idle tick's
  linked = dataclasses.replace(c, latency=0.01, activation_bytes=1.0, bandwidth=math.inf)
  ticks = tables.ticks(tables.place(tables.build('gpipe', 2, 4)))
  assert sim.simulate(_run(name='gpipe', microbatches=4), linked, lockstep=True).step_time == (
    pytest.approx(step('gpipe', True) + ticks * 0.01, abs=TOL)
  )


@pytest.mark.parametrize('name', ['zb_h1', 'zb_v'])
@pytest.mark.parametrize('share', [0.5, 0.58, 0.7])
def test_a_split_backward_gives_b_its_measured_share_and_w_the_rest(name, share):
  """Straight from the lockstep equations: a step of a zero-bubble table is the sum over its
  ticks of the slowest device's operation, F = f / (M v), B = share b / (M v), W = (1 - share)
  b / (M v) (free links, no head). A fused table's B is all of b whatever the share."""
  f, b, m = 1.0, 2.0, 4
  c = costs([f] * 2, [b] * 2, input_grad_share=share)
  placed = tables.place(tables.build(name, 2, m))
  v = placed.pipeline.chunks
  op_s = {'F': f / (m * v), 'B': share * b / (m * v), 'W': (1 - share) * b / (m * v)}
  reference = sum(
    max(op_s[row[tick].kind] if row[tick] else 0.0 for row in placed.grid)
    for tick in range(len(placed.grid[0]))
  )
  config = _run(name=name, microbatches=m)
  assert sim.simulate(config, c, lockstep=True).step_time == pytest.approx(reference, abs=TOL)
  fused = _run(name='1f1b', microbatches=m)
  assert sim.simulate(fused, c, lockstep=True).step_time == pytest.approx(
    sim.simulate(fused, costs([f] * 2, [b] * 2), lockstep=True).step_time, abs=TOL
  )
  for wrong in (0.0, 1.0):
    with pytest.raises(ValueError, match='input_grad_share'):
      costs([f], [b], input_grad_share=wrong)


def test_costs_from_one_measured_layer_scale_by_each_stage_s_layers(experiment):
  """experiments/layer_costs.py's rows -> StageCosts (experiments/simulate.py's
  `measured_transformer_costs`): every stage pays its layers' measured forward, backward and
  update, device 0 also the head and the embedding's update, and a measured micro-batch replaces
  the division by M."""
  model = sim_costs.ModelShape('m', num_layers=4, d_model=8, d_ff=32, seq_len=4, vocab=16, batch=32)
  row = lambda f, b: {
    'fwd_s_per_layer': f,
    'bwd_s_per_layer': b,
    'head_s': 3.0,
    'update_s_per_layer_adamw': 0.5,
    'update_s_embed_head_adamw': 0.25,
  }
  costs = experiment.measured_transformer_costs(
    model, sim_costs.NVLINK, 2, {32: row(1.0, 2.0), 4: row(0.2, 0.3)}
  )
  layers = cost_model.balance_layers(4, 2, 3.0, 3.0)
  assert sum(layers) == 4 and layers[0] < layers[1]  # device 0 carries the head
  assert costs.forward_s == tuple(1.0 * n for n in layers)
  assert costs.backward_s == tuple(2.0 * n for n in layers)
  assert costs.update_s == (0.5 * layers[0] + 0.25, 0.5 * layers[1])
  assert costs.head_s == 3.0 and costs.bandwidth == sim_costs.NVLINK.bandwidth
  assert costs.microbatch_forward_s == {8: tuple(0.2 * n for n in layers)}
  assert costs.microbatch_backward_s == {8: tuple(0.3 * n for n in layers)}


# ----------------------------------------------------------------------------- FSDP


def _fsdp_costs(G, D, f, h, a, **extra):
  """G groups whose forward on one replica's B / D rows takes f (backward 2f), a head of h, no
  embedding, and weights whose ring gather over D chips takes a (no latency)."""
  nbytes = a * 1e9 * D / (D - 1)  # (D - 1) / D of it at 1e9 B/s: a seconds
  return sim_costs.StageCosts(
    forward_s=[D * f] * G,
    backward_s=[2 * D * f] * G,
    head_s=D * h,
    param_bytes=[nbytes] * G,
    grad_bytes=G * nbytes,
    bandwidth=1e9,
    batch_size=8,
    **extra,
  )


@pytest.mark.parametrize('G,D', [(4, 2), (6, 4)])
def test_fsdp_hides_its_gathers_behind_compute_and_is_bound_by_them_when_slower(G, D):
  """FSDP's closed forms, one group's gather prefetched, a reduction taking s times a gather
  (`reduce_scale`: float32 gradients of weights gathered in bfloat16, s = 2). Compute-bound
  (s a <= f, a <= h): only the first gather and the last reduction show, 3Gf + h + a + s a.
  Network-bound (a >= 2f, h <= a): the network is never idle but while the last group's forward
  runs, (2 + s) G a + f (G gathers forward, G gathers and G reductions backward)."""
  fsdp = _run(name='data_parallel', data_parallel=D, fsdp=True)
  f, h = 1.0, 1.5
  for s in (1.0, 2.0):
    for a in (0.3, 0.5):  # compute-bound
      step = sim.simulate(fsdp, _fsdp_costs(G, D, f, h, a, reduce_scale=s)).step_time
      assert step == pytest.approx(3 * G * f + h + a + s * a, abs=TOL)
    for a in (2.0, 3.5):  # network-bound
      step = sim.simulate(fsdp, _fsdp_costs(G, D, f, h, a, reduce_scale=s)).step_time
      assert step == pytest.approx((2 + s) * G * a + f, abs=TOL)
  # Beside plain data parallelism on the same costs: its all-reduce (2 (D-1)/D of every byte)
  # after the backward, none of it hidden.
  c = _fsdp_costs(G, D, f, h, 0.3)
  plain = sim.simulate(_run(name='data_parallel', data_parallel=D), c).step_time
  assert plain == pytest.approx(3 * G * f + h + 2 * G * 0.3, abs=TOL)
  no_weights = dataclasses.replace(c, param_bytes=())
  with pytest.raises(ValueError, match='param_bytes'):
    sim.simulate(fsdp, no_weights)


def test_a_collective_across_slices_crosses_the_slow_network_once_per_shard():
  """Two levels: D = 16 chips in 2 slices of 8. The chips of one index gather across the slices
  (1/2 of n / 8 each at the data-centre rate), then each slice gathers inside (7/8 of n)."""
  n, inside, dcn = 8e9, 100e9, 5e9
  c = sim_costs.StageCosts(
    forward_s=[1.0],
    backward_s=[2.0],
    bandwidth=50e9,
    collective_bandwidth=inside,
    dcn_bandwidth=dcn,
    slice_chips=8,
    latency=1e-5,
    grad_bytes=n,
  )
  two_slices = 7 / 8 * n / inside + 7e-5 + 1 / 2 * n / 8 / dcn + 1e-5
  assert c.collective_s(n, 16) == pytest.approx(two_slices, rel=1e-12)
  assert c.collective_s(n, 8) == pytest.approx(7 / 8 * n / inside + 7e-5, rel=1e-12)
  one_link = dataclasses.replace(c, collective_bandwidth=None, slice_chips=0)
  assert one_link.collective_s(n, 16) == pytest.approx(15 / 16 * n / 50e9 + 15e-5, rel=1e-12)
  assert c.allreduce_time(16) == pytest.approx(2 * two_slices, rel=1e-12)
  with pytest.raises(ValueError, match='slices of 8'):
    c.collective_s(n, 12)


def test_a_stage_schedule_on_data_replicas_all_reduces_each_stage_after_its_last_compute():
  """model_parallel, G = 2, on R = 2 replicas, free links between stages: device 1's backward
  ends at T1 = E + f0 + f1 + h + b1, device 0's at T0 = T1 + b0 + E'; each all-reduces its own
  stage's gradient (device 0's with the embedding) then, 2 (R - 1) / R of it, device 1's while
  device 0 still computes. The step is the later of the two."""
  E, f0, f1, h, b1, b0, Eb = 0.1, 1.0, 1.5, 0.5, 3.0, 2.0, 0.2
  T1 = E + f0 + f1 + h + b1
  T0 = T1 + b0 + Eb
  hybrid = _run(name='model_parallel', num_stages=2, data_parallel=2)
  for p0, p1, embedding in ((1e9, 2e9, 0.5e9), (1e9, 9e9, 0.0)):
    c = costs(
      [f0, f1],
      [b0, b1],
      head_s=h,
      embed_forward_s=E,
      embed_backward_s=Eb,
      param_bytes=[p0, p1],
      grad_bytes=p0 + p1 + embedding,
      collective_bandwidth=1e9,
    )
    expected = max(T1 + (p1 / 1e9), T0 + (p0 + embedding) / 1e9)  # 2 x 1/2 of the bytes
    assert sim.simulate(hybrid, c).step_time == pytest.approx(expected, abs=TOL)
    wide = dataclasses.replace(c, reduce_scale=2.0)  # float32 gradients, bfloat16 counts
    expected = max(T1 + 2 * p1 / 1e9, T0 + 2 * (p0 + embedding) / 1e9)
    assert sim.simulate(hybrid, wide).step_time == pytest.approx(expected, abs=TOL)
    one = sim.simulate(_run(name='model_parallel', num_stages=2), c).step_time
    assert one == pytest.approx(T0, abs=TOL)
  with pytest.raises(ValueError, match='param_bytes'):
    sim.simulate(hybrid, costs([f0, f1], [b0, b1]))


def test_shard_update_splits_each_update_over_the_replicas_then_gathers_the_weights_once():
  """--shard-update (ZeRO-1) on the hybrid above, float32 weights gathered in bfloat16
  (reduce_scale 2): each stage's gradient reduce-scattered (one pass of the all-reduce's two),
  device 0's embedding's too, then each device's update on 1/R of its stage,
  then its stage's stored weights gathered over the R = 2 replicas, (R - 1) / R of them; and
  data_parallel on D = 2: its gradients reduce-scattered, 1/D of the whole update, then the
  whole model's weights gathered: one gather saved against the all-reduce's second pass."""
  E, f0, f1, h, b1, b0, Eb, u0, u1 = 0.1, 1.0, 1.5, 0.5, 3.0, 2.0, 0.2, 0.4, 0.6
  p0, p1, embedding = 1e9, 2e9, 0.5e9
  c = costs(
    [f0, f1], [b0, b1], head_s=h, embed_forward_s=E, embed_backward_s=Eb, update_s=[u0, u1],
    param_bytes=[p0, p1], grad_bytes=p0 + p1 + embedding, collective_bandwidth=1e9,
    reduce_scale=2.0,
  )  # fmt: skip
  T1 = E + f0 + f1 + h + b1
  T0 = T1 + b0 + Eb
  clipped = max(T1 + 2 * p1 / 1e9, T0 + 2 * (p0 + embedding) / 1e9)  # the all-reduces ended
  hybrid = _run(name='model_parallel', num_stages=2, data_parallel=2)
  assert sim.simulate(hybrid, c).step_time == pytest.approx(clipped + u1, abs=TOL)
  sharded = dataclasses.replace(hybrid, shard_update=True)
  scattered = max(T1 + p1 / 1e9, T0 + (p0 + embedding) / 1e9)
  expected = scattered + max(u0 / 2 + (p0 + embedding) / 1e9, u1 / 2 + p1 / 1e9)
  assert sim.simulate(sharded, c).step_time == pytest.approx(expected, abs=TOL)
  whole = costs(
    [f0 + f1], [b0 + b1], head_s=h, embed_forward_s=E, embed_backward_s=Eb, update_s=[u0 + u1],
    grad_bytes=p0 + p1 + embedding, collective_bandwidth=1e9, reduce_scale=2.0,
  )  # fmt: skip
  replicated = _run(name='data_parallel', data_parallel=2)
  saved = (
    sim.simulate(replicated, whole).step_time
    - sim.simulate(dataclasses.replace(replicated, shard_update=True), whole).step_time
  )
  assert saved == pytest.approx((u0 + u1) / 2, abs=TOL)  # the gather is the saved pass
  with pytest.raises(ValueError, match='param_bytes'):
    sim.simulate(sharded, dataclasses.replace(c, param_bytes=()))


def test_fsdp_in_a_stage_schedule_gathers_each_operations_layers_and_reduce_scatters_them():
  """The same, with --fsdp (layer_shards): each forward and backward first gathers its stage's
  layers over the R = 2 replicas (1/2 of their bytes a pass), again for the backward, the
  device's network prefetching one operation ahead; each backward's gradient is reduce-scattered
  once it ends (on the network after the next gather); device 0's embedding is gathered once
  and all-reduced at the end (two passes)."""
  E, f0, f1, h, b1, b0, Eb = 0.1, 1.0, 1.5, 0.5, 3.0, 2.0, 0.2
  sharded = _run(name='model_parallel', num_stages=2, data_parallel=2, fsdp=True)
  for p0, p1, embedding in ((1e9, 2e9, 0.5e9), (1e9, 9e9, 0.0)):  # the second: device 1 waits
    c = costs(
      [f0, f1], [b0, b1], head_s=h, embed_forward_s=E, embed_backward_s=Eb,
      param_bytes=[p0, p1], grad_bytes=p0 + p1 + embedding, collective_bandwidth=1e9,
    )  # fmt: skip
    ge, h0, h1 = embedding / 2e9, p0 / 2e9, p1 / 2e9
    F0 = ge + max(E, h0) + f0  # the embedding's gather, then its forward beside stage 0's gather
    F1 = max(h1, F0) + f1
    B1 = max(F1 + h, 2 * h1) + b1  # the head, then stage 1's second gather
    B0 = max(B1, F0 + h0) + b0  # stage 0's second gather began as its forward ended
    # device 0: its reduce-scatter and embedding backward, then the embedding's all-reduce
    device0 = max(B0 + h0, B0 + Eb) + (2 * ge if embedding else 0.0)
    expected = max(device0, B1 + h1)  # device 1's reduce-scatter
    assert sim.simulate(sharded, c).step_time == pytest.approx(expected, abs=TOL)
    # float32 gradients of weights gathered in bfloat16: every reduction twice as long
    device0 = max(B0 + 2 * h0, B0 + Eb) + (4 * ge if embedding else 0.0)
    wide = dataclasses.replace(c, reduce_scale=2.0)
    expected = max(device0, B1 + 2 * h1)
    assert sim.simulate(sharded, wide).step_time == pytest.approx(expected, abs=TOL)
