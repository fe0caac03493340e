"""A cluster profile as data: curves, the matmul table, the file, and what a mesh reads of
it (no device used; ``tests/test_mesh_profiling.py`` measures one)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

import alpa
from alpa.cost_profile import (
    ClusterProfile,
    Curve,
    DotTable,
    GroupLayout,
    MeshRates,
    axis_layouts,
    load_profiles,
    save_profiles,
)
from alpa.device_mesh import ClusterSpec, LogicalDeviceMesh, VirtualPhysicalMesh
from alpa.saved_format import NewerFormatError

SIZES = (16, 64, 256)
DOT_RATE = 1e10  # FLOP/s at every grid point but the smallest cube
COLLECTIVE_LATENCY = 1e-4
COLLECTIVE_BANDWIDTH = 1e9
MEMORY_SECONDS_PER_BYTE = 1e-10


def dot_table(rate: float = DOT_RATE) -> DotTable:
    s = np.asarray(SIZES, dtype=float)
    flops = 2 * s[:, None, None] * s[None, :, None] * s[None, None, :]
    seconds = flops / rate
    seconds[0, 0, 0] *= 4  # the smallest cube runs at a quarter of the rate
    return DotTable(SIZES, seconds.tolist())


def linear(latency: float, bandwidth: float) -> Curve:
    sizes = (1024.0, 1 << 16, 1 << 20)
    return Curve(sizes, tuple(latency + s / bandwidth for s in sizes))


def make_profile(per_host: int = 8, concurrency=None, **changes) -> ClusterProfile:
    """A profile with closed-form figures: every collective ``latency + bytes /
    bandwidth`` for the group layouts of one host of ``per_host`` devices."""
    layouts = [GroupLayout(g, n) for g in (2, 4, 8) for n in (1, 2, 4) if g * n <= per_host]
    curve = linear(COLLECTIVE_LATENCY, COLLECTIVE_BANDWIDTH)
    collectives = {
        kind: {layout.key(): curve for layout in layouts}
        for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")
    }
    profile = ClusterProfile(
        device_kind="cpu",
        platform="cpu",
        num_hosts=1,
        num_devices_per_host=per_host,
        dot={"float32": dot_table()},
        memory=Curve((1024.0, 1 << 20), (1024 * MEMORY_SECONDS_PER_BYTE, (1 << 20) * 1e-10)),
        concurrency=concurrency or {1: 1.0, 8: 0.25},
        collectives=collectives,
        cross_mesh=linear(1e-4, 1e9),
        instruction_seconds=2e-4,
        launch_seconds=3e-4,
    )
    return dataclasses.replace(profile, **changes)


# ----------------------------------------------------------------------------- curves


def test_a_curve_interpolates_and_extrapolates_at_its_best_bandwidth():
    curve = Curve((0.0, 100.0, 300.0), (1.0, 2.0, 3.0))
    assert curve(-5) == 1.0 and curve(0) == 1.0
    assert curve(50) == pytest.approx(1.5)
    assert curve(200) == pytest.approx(2.5)
    # Past the last point: at the best bandwidth of any point (100 B/s at 300 B in 3 s).
    assert curve.best_bandwidth == pytest.approx(100.0)
    assert curve(500) == pytest.approx(3.0 + 200 / 100.0)


def test_monotone_curves_never_reward_a_noisy_point():
    # Noise only adds time: 100 B measured slower than 200 B is lowered to 200 B's
    # seconds; 400 B measured slower per byte than 200 B is held at 200 B's bandwidth.
    curve = Curve.monotone([(400, 10.0), (100, 2.0), (200, 1.0)])
    assert curve.sizes == (100.0, 200.0, 400.0)
    assert curve.seconds == (1.0, 1.0, 2.0)  # 100 B/s at 200 B: 400 B takes 2 s, not 10
    assert all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:], strict=False))


def test_bad_curves_and_tables_are_refused_by_name():
    with pytest.raises(ValueError, match="sizes must increase"):
        Curve((2.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="as many seconds as sizes"):
        Curve((1.0,), ())
    with pytest.raises(ValueError, match=r"seconds of shape \(3, 3, 3\)"):
        DotTable(SIZES, [[1.0]])


# ----------------------------------------------------------------------------- matmuls


def test_the_dot_table_is_exact_on_the_grid_and_never_above_the_best_rate():
    table = dot_table()
    assert table.best_rate == pytest.approx(DOT_RATE)
    assert table.rate(64, 256, 16) == pytest.approx(DOT_RATE)
    assert table.rate(16, 16, 16) == pytest.approx(DOT_RATE / 4)
    # Between the smallest cube and its neighbours: between their rates, in log space.
    between = table.rate(32, 16, 16)
    assert DOT_RATE / 4 < between < DOT_RATE
    assert between == pytest.approx(DOT_RATE / 2)  # halfway in log(m): sqrt(1/4)
    # Past the grid: the last point's rate, never more.
    assert table.rate(4096, 4096, 4096) == pytest.approx(DOT_RATE)
    # Below the grid: latency-bound, the rate scales with the dimension.
    assert table.rate(4, 256, 256) == pytest.approx(DOT_RATE * 4 / 16)


# ----------------------------------------------------------------------------- the file


def test_a_profile_round_trips_through_its_file(tmp_path):
    profile = make_profile(meta={"note": "test"})
    path = tmp_path / "profile.json"
    save_profiles(str(path), [profile])
    (loaded,) = load_profiles(str(path)).values()
    assert loaded == profile and loaded.key == "cpu/1x8"
    assert loaded.meta == {"note": "test"}
    assert loaded.collective_curve("all-reduce", GroupLayout(8, 1)) == linear(
        COLLECTIVE_LATENCY, COLLECTIVE_BANDWIDTH
    )
    # A changed figure is another profile.
    assert dataclasses.replace(profile, instruction_seconds=1.0) != profile


def test_a_file_of_another_format_or_none_is_refused_clearly(tmp_path):
    path = tmp_path / "profile.json"
    save_profiles(str(path), [make_profile()])
    data = json.loads(path.read_text())
    data["format"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(
        NewerFormatError,
        match=rf"^{re.escape(repr(str(path)))} is a cluster profile of format 99, newer than "
        r"this alpa reads \(format 1 and older\).*profile the cluster again",
    ):
        load_profiles(str(path))
    data["format"] = "one"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"its 'format' is 'one', where a format version"):
        load_profiles(str(path))
    # A profile inside the file of a newer format is refused by its key.
    data["format"] = 1
    (key,) = data["profiles"]
    data["profiles"][key]["format"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(NewerFormatError, match=rf"profile '{re.escape(key)}' is a cluster profile"):
        load_profiles(str(path))
    path.write_text("not json")
    with pytest.raises(ValueError, match="not a cluster profile"):
        load_profiles(str(path))
    with pytest.raises(FileNotFoundError, match="profile_all"):
        load_profiles(str(tmp_path / "missing.json"))


def test_concurrency_never_rises_with_more_devices():
    profile = make_profile(concurrency={1: 1.0, 2: 0.4, 4: 0.5, 8: 0.2})
    assert profile.concurrency == {1: 1.0, 2: 0.4, 4: 0.4, 8: 0.2}
    # Between measured counts: interpolated in log k.
    assert profile.concurrency_factor(3) == pytest.approx(0.4)
    assert profile.concurrency_factor(64) == 0.2


# ----------------------------------------------------------------------------- a mesh


def test_group_layouts_of_logical_views():
    assert axis_layouts((1, 8), (2, 4)) == (GroupLayout(2, 4), GroupLayout(4, 2))
    assert axis_layouts((1, 8), (1, 8))[1] == GroupLayout(8, 1)
    # Two hosts of 4: axis 0 of (2, 4) spans them, axis 1 does not.
    assert axis_layouts((2, 4), (2, 4)) == (GroupLayout(2, 4, True), GroupLayout(4, 1))


def test_a_mesh_of_a_profiled_cluster_prices_at_the_measured_rates():
    cluster = ClusterSpec.preset("cpu", 1, 8).with_profile(make_profile())
    mesh = VirtualPhysicalMesh(1, 8, cluster=cluster).get_logical_mesh((2, 4))
    assert mesh.rates == MeshRates(cluster.profile, (1, 8))
    nbytes = 1 << 18
    measured = COLLECTIVE_LATENCY + nbytes / COLLECTIVE_BANDWIDTH
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert getattr(mesh, f"{kind}_cost")(nbytes, 1) == pytest.approx(measured)
    assert mesh.collective_latency("all-reduce", 0) == pytest.approx(
        COLLECTIVE_LATENCY + 1024 / COLLECTIVE_BANDWIDTH
    )
    # Work: a (64, 64) @ (64, 256) matmul at the grid's rate with 8 devices at 0.25 of it,
    # and its 64 KiB result at the memory curve's rate, over the same concurrency.
    flops = 2 * 64 * 64 * 256
    seconds = mesh.compute_cost(flops, 65536, (1, 64, 64, 256))
    assert seconds == pytest.approx(flops / (DOT_RATE * 0.25) + 65536 * 1e-10 / 0.25)
    # Explicit alpha-beta (Alpa's unit-free convention) replaces the measured rates.
    plain = mesh.with_alpha_beta((1.0, 1.0), (1.0, 1.0))
    assert plain.rates is None and plain.all_reduce_cost(100, 1) == 1 + 2 * 3 / 4 * 100


def test_a_layout_the_profile_lacks_falls_back_to_alpha_beta():
    # A two-host cluster profiled on one host: groups across hosts were not measured.
    cluster = ClusterSpec.preset("cpu", 2, 4).with_profile(make_profile(per_host=4))
    mesh = VirtualPhysicalMesh(2, 4, cluster=cluster).get_logical_mesh((2, 4))
    inside = mesh.all_reduce_cost(1 << 16, 1)
    assert inside == pytest.approx(COLLECTIVE_LATENCY + (1 << 16) / COLLECTIVE_BANDWIDTH)
    across = mesh.all_reduce_cost(1 << 16, 0)
    alpha, beta = mesh.mesh_alpha[0], mesh.mesh_beta[0]
    assert across == pytest.approx(alpha + beta * 2 * (1 / 2) * (1 << 16))


def test_a_cluster_spec_reads_its_profile_from_a_file(tmp_path):
    path = tmp_path / "profile.json"
    save_profiles(str(path), [make_profile()])
    spec = ClusterSpec.from_profile(str(path))
    assert (spec.num_nodes, spec.num_devices_per_node, spec.name) == (1, 8, "cpu")
    assert spec.profile == make_profile()
    # The datasheet figures stay (the hardware limit is computed from them).
    assert spec.device_flops == ClusterSpec.preset("cpu").device_flops
    assert ClusterSpec.local(profile=str(path)).profile == make_profile()
    assert ClusterSpec.local().profile is None
    alpa.global_config.cluster_profile = str(path)
    try:
        assert ClusterSpec.local().profile == make_profile()
    finally:
        alpa.global_config.cluster_profile = None
    other = dataclasses.replace(make_profile(), device_kind="NVIDIA H100")
    save_profiles(str(path), [other])
    with pytest.raises(ValueError, match=r"no profile of 'cpu' devices .*NVIDIA H100/1x8"):
        ClusterSpec.local(profile=str(path))
    with pytest.raises(TypeError, match="ClusterSpec.profile must be a ClusterProfile"):
        ClusterSpec.preset("cpu").with_profile("profile.json")


def test_plain_logical_meshes_price_as_before():
    mesh = LogicalDeviceMesh((2, 4), (1.0, 2.0), (0.5, 0.25))
    assert mesh.rates is None
    assert mesh.all_reduce_cost(1000, 1) == 2.0 + 0.25 * 2 * 3 / 4 * 1000
    assert mesh.collective_latency("all-reduce", 1) == 2.0
    assert mesh.compute_cost(1000, 10) == 1000 / 1000.0 + 10 / 10.0
    assert math.isclose(mesh.all_to_all_cost(1600, 1), 2.0 + 0.25 * 3 / 16 * 1600 * 1.5)
