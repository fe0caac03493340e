"""``alpa.global_config``: Alpa's settings accepted, every value checked where it enters
(an assignment, an environment variable), unknown names refused, and the settings that
mean something here doing it."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

import alpa
from alpa.global_env import RETIRED_SETTINGS, GlobalConfig, global_config

#: The settings of Alpa's ``GlobalConfig`` (Alpa 0.2.3, ``alpa/global_env.py``), with a
#: value an Alpa script could assign to each.
ALPA_SETTINGS = {
    "backend": "gpu",
    "has_cuda": False,
    "xla_client_mem_fraction": 0.8,
    "xla_client_client_preallocate": "false",
    "delete_remote_arrays_threshold": 0,
    "compile_random_seed": 1,
    "runtime_random_seed": 2,
    "xla_server_port_start": 21000,
    "xla_server_port_end": 22000,
    "xla_gpu_autotune_level": 0,
    "use_aws_efa": True,
    "shard_parallel_sync_for_timer": True,
    "debug_with_pipeshard_runtime": True,
    "profile_with_whole_ray_cluster": False,
    "profile_timeout": 100,
    "profile_maximum_retry": 0,
    "overwrite_submesh_choices": [(1, 2), (1, 4)],
    "always_donate_micro_batch_vars": False,
    "pipeline_sync_for_timer": True,
    "pipeline_distributed_compile": False,
    "eagerly_create_communicators": False,
    "pipeline_check_alive": True,
    "pipeline_use_signal_send_recv": True,
    "use_local_allgather": False,
    "resharding_mode": "broadcast",
    "nccl_mode": "xla_extension",
    "enable_overlapping": True,
    "resharding_loadbalance_mode": "loadbalance_order",
    "loadbalance_order_algo": "search",
    "use_dummy_value_for_benchmarking": True,
    "flax_always_use_fp16_embedding": True,
    "print_compilation_time": True,
    "print_auto_layer_stats": True,
    "collect_trace": True,
}


@pytest.fixture
def restored_config():
    """``global_config`` as it was before the test, whatever the test assigns."""
    saved = {f.name: getattr(global_config, f.name) for f in dataclasses.fields(GlobalConfig)}
    yield global_config
    for name, value in saved.items():
        object.__setattr__(global_config, name, value)


def test_every_setting_of_alpa_is_accepted_and_kept(restored_config):
    for name, value in ALPA_SETTINGS.items():
        setattr(restored_config, name, value)
    kept = {name: getattr(restored_config, name) for name in ALPA_SETTINGS}
    assert kept["overwrite_submesh_choices"] == ((1, 2), (1, 4))
    assert kept["profile_timeout"] == 100.0 and type(kept["profile_timeout"]) is float
    assert {k: v for k, v in kept.items() if k not in ("overwrite_submesh_choices",)} == {
        k: v for k, v in ALPA_SETTINGS.items() if k not in ("overwrite_submesh_choices",)
    }
    assert restored_config.ray_accelerator_name == "GPU"


def test_a_name_alpa_never_had_is_refused(restored_config):
    with pytest.raises(
        AttributeError,
        match=r"^alpa.global_config has no setting 'pipeline_distributed_compiles' \(set to "
        r"False\); neither has Alpa's\. Its settings are .*pipeline_distributed_compile,",
    ):
        restored_config.pipeline_distributed_compiles = False
    assert not hasattr(restored_config, "pipeline_distributed_compiles")


def test_a_setting_of_an_older_alpa_warns_and_does_nothing(restored_config):
    with pytest.warns(UserWarning, match=r"remat_using_while = True does nothing: .* 0\.2\.1"):
        restored_config.remat_using_while = True
    assert restored_config.remat_using_while is False  # Alpa's default, never changed
    assert set(RETIRED_SETTINGS).isdisjoint(f.name for f in dataclasses.fields(GlobalConfig))


# -- values checked when assigned


@pytest.mark.parametrize(
    "name, value, error, expected",
    [
        ("ilp_time_limit", "fast", TypeError, r"'fast' \(str\): expected a number > 0"),
        ("ilp_time_limit", 0, ValueError, r"0 \(int\): expected a number > 0"),
        ("ilp_time_limit", float("inf"), ValueError, r"inf \(float\): expected a number > 0"),
        ("ray_worker_timeout", -1, ValueError, r"-1 \(int\): expected a number > 0 \(inf"),
        ("ray_connect_timeout", None, TypeError, r"None \(NoneType\): expected a number > 0"),
        ("ilp_solver", "gurobi", ValueError, r"'gurobi' \(str\): expected one of 'highs', 'cbc'"),
        ("use_tqdm", "no", TypeError, r"'no' \(str\): expected True or False"),
        ("seed", 2**32, ValueError, r"4294967296 \(int\): expected an int in \[0, 4.29497e\+09\]"),
        ("cache_dir", "", ValueError, r"'' \(str\): expected a non-empty path"),
        ("delete_remote_arrays_threshold", 1.5, TypeError, r"expected an int >= 0"),
        ("xla_client_mem_fraction", 1.5, ValueError, r"expected a number in \(0, 1\]"),
        ("xla_gpu_autotune_level", 5, ValueError, r"expected an int in \[0, 4\]"),
        ("resharding_mode", "nccl", ValueError, r"expected one of 'send_recv', 'broadcast'"),
        ("overwrite_submesh_choices", [(1, 0)], ValueError, r"pairs of positive ints"),
        ("xla_client_client_preallocate", "maybe", ValueError, r"expected 'true' or 'false'"),
    ],
)
def test_a_bad_value_is_refused_when_assigned(restored_config, name, value, error, expected):
    before = getattr(restored_config, name)
    with pytest.raises(error, match=rf"^alpa.global_config.{name} = .*{expected}"):
        setattr(restored_config, name, value)
    assert getattr(restored_config, name) == before


def test_values_are_normalized(restored_config):
    import numpy as np

    restored_config.ilp_time_limit = np.int64(5)
    assert restored_config.ilp_time_limit == 5.0 and type(restored_config.ilp_time_limit) is float
    restored_config.ray_worker_timeout = float("inf")  # no limit
    restored_config.use_tqdm = np.bool_(False)
    assert restored_config.use_tqdm is False
    restored_config.xla_client_client_preallocate = False
    assert restored_config.xla_client_client_preallocate == "false"


# -- values checked when read from the environment


@pytest.mark.parametrize(
    "variable, text, expected",
    [
        ("ALPA_ILP_TIME_LIMIT", "abc", "ilp_time_limit): expected a number > 0"),
        ("ALPA_RAY_WORKER_TIMEOUT", "-1", "ray_worker_timeout): expected a number > 0"),
        ("ALPA_DISABLE_TQDM", "sometimes", "use_tqdm): expected one of 1, true, yes"),
        ("ALPA_SEED", "-3", "seed): expected an int in [0, "),
        ("ALPA_ILP_SOLVER", "glpk", "ilp_solver): expected one of 'highs', 'cbc'"),
        ("XLA_SERVER_PORT_START", "0x10", "xla_server_port_start): expected an int in [1, "),
    ],
)
def test_a_bad_environment_variable_is_refused(monkeypatch, variable, text, expected):
    monkeypatch.setenv(variable, text)
    prefix = f"environment variable {variable}='{text}' (alpa.global_config."
    with pytest.raises(ValueError, match="^" + re.escape(prefix + expected)):
        GlobalConfig()


def test_environment_variables_are_read():
    env = {
        "ALPA_ILP_TIME_LIMIT": "7.5",
        "ALPA_DISABLE_TQDM": "TRUE",
        "ALPA_USE_AWS_EFA": "1",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        config = GlobalConfig()
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    assert config.ilp_time_limit == 7.5
    assert config.use_tqdm is False
    assert config.use_aws_efa is True
    assert config.xla_client_mem_fraction == 0.5


def test_importing_alpa_with_a_bad_variable_says_which():
    env = dict(os.environ, ALPA_ILP_TIME_LIMIT="abc")
    result = subprocess.run(
        [sys.executable, "-c", "import alpa.global_env"], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "ValueError: environment variable ALPA_ILP_TIME_LIMIT='abc'" in result.stderr


# -- settings with a meaning here


def test_set_seed_sets_alpas_runtime_random_seed(restored_config):
    alpa.set_seed(11)
    assert restored_config.seed == 11 and restored_config.runtime_random_seed == 11


def test_gpu_workers_get_alpas_xla_and_efa_settings(restored_config, monkeypatch):
    from alpa.runtime.ray_mesh import gpu_worker_env_vars

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=2")
    restored_config.xla_client_mem_fraction = 0.5
    restored_config.xla_client_client_preallocate = False
    restored_config.xla_gpu_autotune_level = 0
    env = gpu_worker_env_vars()
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_autotune_level=0"
    assert "FI_PROVIDER" not in env
    restored_config.use_aws_efa = True
    env = gpu_worker_env_vars()
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_PROTO"] == "simple"


def test_overwrite_submesh_choices_are_the_stage_dps(restored_config, capsys):
    import jax

    from alpa.device_mesh import ClusterSpec
    from alpa.model.mlp import MLPModel, get_mlp_train_state_and_step
    from alpa.pipeline_parallel.stages.stage_construction import AutoStageOption, StageContext
    from alpa.pipeline_parallel.stages.stage_search import stage_problem

    model = MLPModel(hidden_size=16, num_layers=3, output_dim=16)
    state, batch, step = get_mlp_train_state_and_step(
        model, 16, 16, grad_func=alpa.value_and_grad, abstract=True
    )
    restored_config.print_auto_layer_stats = True
    method = alpa.PipeshardParallel(
        num_micro_batches=2, layer_option=alpa.AutoLayerOption(layer_num=2), stage_option="uniform"
    )
    plan = alpa.parallelize(step, method=method).plan(state, batch)
    printed = capsys.readouterr().out
    assert "AutoLayerOption: 2 layers of the loss function" in printed
    assert "  layer 0: " in printed and "  layer 1: " in printed

    def choices():
        context = StageContext(
            2, ClusterSpec.local(), jax.devices(), plan.traced, plan.layers, plan.names, 2
        )
        return stage_problem(AutoStageOption(), context).submesh_choices

    assert choices() == ((1, 1), (1, 2), (1, 4), (1, 8))
    restored_config.overwrite_submesh_choices = [(1, 2), (1, 4)]
    assert choices() == ((1, 2), (1, 4))
    restored_config.overwrite_submesh_choices = [(1, 3)]
    with pytest.raises(ValueError, match=r"submesh \(1, 3\) does not tile a host of 8"):
        choices()
