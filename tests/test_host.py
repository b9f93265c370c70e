"""The host settings apply only to the CPU backend, and only with flags the installed XLA knows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ouroboros_jax import host

REGION = host.CPU_XLA_FLAGS[0].split('=')[0]


@pytest.mark.parametrize('platforms, expected', [('cuda', False), ('tpu,cpu', False),
                                                 ('cpu', True), ('CPU,cuda', True)])
def test_the_backend_named_by_jax_platforms_decides(monkeypatch, platforms, expected):
  monkeypatch.setenv('JAX_PLATFORMS', platforms)
  assert host.cpu_backend_expected() is expected


def test_an_installed_accelerator_plugin_means_not_cpu(monkeypatch):
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  monkeypatch.delenv('JAX_PLATFORM_NAME', raising=False)
  real = host.importlib.util.find_spec
  monkeypatch.setattr(host.importlib.util, 'find_spec',
                      lambda name, *a: object() if name == 'jax_cuda12_plugin' else real(name, *a))
  assert host.cpu_backend_expected() is False


def test_on_an_accelerator_nothing_is_changed():
  # A fresh process: the settings would otherwise leak into this one.
  code = ('import os; from ouroboros_jax import host; '
          'print(host.configure_cpu_runtime(), repr(os.environ.get("XLA_FLAGS", "")))')
  env = {**os.environ, 'JAX_PLATFORMS': 'cuda', 'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                       timeout=60, check=True).stdout.split()
  assert out == ['False', "'--xla_dump_to=/tmp/x'"]


def test_the_real_flag_is_known_to_the_installed_xla():
  assert host.xla_knows_flag(REGION)
  assert not host.xla_knows_flag('xla_cpu_no_such_flag_in_any_build')


def test_an_unknown_flag_is_skipped_with_one_warning(monkeypatch, capsys):
  monkeypatch.setattr(host, 'CPU_XLA_FLAGS',
                      ('--xla_cpu_renamed_away_flag=true', *host.CPU_XLA_FLAGS))
  monkeypatch.setenv('XLA_FLAGS', '')
  host.use_cpu_xla_flags()
  assert os.environ['XLA_FLAGS'].split() == list(host.CPU_XLA_FLAGS[1:])
  warning = capsys.readouterr().err.strip().splitlines()
  assert warning == ['warning: this XLA does not know --xla_cpu_renamed_away_flag; skipped that '
                     'speed setting (results are unchanged).']


def test_a_flag_the_user_set_wins(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', f'{REGION}=false')
  host.use_cpu_xla_flags()
  assert os.environ['XLA_FLAGS'] == f'{REGION}=false'
