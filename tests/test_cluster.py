"""Several nodes: the per-node torchrun commands (anywhere), and an emulated 2-host cluster (root only).

The emulated cluster (`par.runtime.cluster`) needs root, `ip` and `tc`: without root the tests that build it are
skipped with the reason; without the binaries they are skipped too, except under CI=true, where a
missing binary fails (CI runs as root and must run them). Every cluster uses a prefix of its own, and
the tests check that no namespace with it is left behind.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiers import slow

from par.runtime.multinode import MultiNode, MultiNodeError

ROOT = Path(__file__).resolve().parents[1]

pytestmark = slow   # the whole module is in the full suite only


# ---------------------------------------------------------------- per-node commands (no root)
def test_under_c10d_every_node_runs_the_same_command():
    nodes = MultiNode(2, 4, "10.0.0.1:29500", rdzv_id="job7")
    cmds = nodes.commands("par.train.job", ["--config", "configs/3d.json"])
    assert len(cmds) == 2 and nodes.world_size == 8 and cmds[0] == cmds[1]
    assert cmds[0][0] == "torchrun" and cmds[0][-4:] == ["-m", "par.train.job", "--config", "configs/3d.json"]
    for flag in ("--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500",
                 "--rdzv-id=job7", "--max-restarts=0"):
        assert flag in cmds[0]
    assert not any(a.startswith("--node-rank") for a in cmds[0])      # torchrun ignores it under c10d
    assert nodes.ranks_of(1) == [4, 5, 6, 7]


def test_static_rendezvous_tells_each_node_its_rank():
    nodes = MultiNode(3, 2, "gpu-a:29500", rdzv_backend="static")
    cmds = nodes.commands("par.train.job")
    for i, cmd in enumerate(cmds):
        assert f"--node-rank={i}" in cmd and "--master-addr=gpu-a" in cmd and "--master-port=29500" in cmd
        assert [a for a in cmd if not a.startswith("--node-rank")] == \
               [a for a in cmds[0] if not a.startswith("--node-rank")]


@pytest.mark.parametrize("bad", [dict(nnodes=0), dict(nproc_per_node=-1), dict(rdzv_endpoint="node0"),
                                 dict(rdzv_endpoint="node0:http"), dict(rdzv_endpoint=":29500"),
                                 dict(rdzv_backend="etcd")])
def test_a_bad_description_is_one_line(bad):
    kw = {**dict(nnodes=2, nproc_per_node=2, rdzv_endpoint="node0:29500"), **bad}
    with pytest.raises(MultiNodeError) as e:
        MultiNode(**kw)
    assert "\n" not in str(e.value)


def test_a_node_rank_outside_the_job_is_refused():
    with pytest.raises(MultiNodeError, match="node_rank must be in 0..1"):
        MultiNode(2, 2, "node0:29500").command("par.train.job", node_rank=2)


def par_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "par", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def test_train_prints_the_command_of_each_node():
    p = par_cli("train", "--config", "configs/3d.json", "--nproc", "8", "--nnodes", "2",
                "--rdzv-endpoint", "gpu-a:29500")
    assert p.returncode == 0, p.stderr
    nodes = [line for line in p.stdout.splitlines() if line.startswith("node ")]
    assert len(nodes) == 2
    assert nodes[0].startswith("node 0 (ranks 0-3): torchrun ") and nodes[1].startswith("node 1 (ranks 4-7): ")
    cmd = shlex.split(nodes[1].split(": ", 1)[1])
    assert "--rdzv-endpoint=gpu-a:29500" in cmd and "--nproc-per-node=4" in cmd and "--nnodes=2" in cmd
    assert cmd[-4:] == ["-m", "par.train.job", "--config", "configs/3d.json"]


@pytest.mark.parametrize("args, says", [
    (["--nproc", "8", "--nnodes", "3"], "do not split over --nnodes 3"),
    (["--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "gpu-a"], "HOST:PORT"),
    (["--nproc", "6", "--nnodes", "2"], "not divisible by pipeline stages"),   # the config's own error
])
def test_train_with_nodes_refuses_bad_input_in_one_line(args, says):
    p = par_cli("train", "--config", "configs/3d.json", *args)
    assert p.returncode == 2 and p.stderr.startswith("error: ") and says in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_the_slurm_template_runs_the_printed_command_on_every_node(tmp_path):
    """configs/slurm/train.sbatch under fake `scontrol`/`srun`: it checks the config, then starts on every node
    exactly the torchrun command of par.runtime.multinode.MultiNode."""
    for tool, body in (("scontrol", 'printf "gpu-a\\ngpu-b\\n"'), ("srun", 'printf "%s\\n" "$@" > "$SRUN_ARGS"')):
        (tmp_path / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_JOB_NODELIST": "gpu-[a-b]", "SLURM_JOB_ID": "77", "PAR_PYTHON": sys.executable,
           "SRUN_ARGS": str(tmp_path / "srun.txt")}
    p = subprocess.run(["bash", "configs/slurm/train.sbatch", "configs/3d.json", "--steps", "5"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "node 1 (ranks 4-7): torchrun" in p.stdout
    started = (tmp_path / "srun.txt").read_text().splitlines()
    want = MultiNode(2, 4, "gpu-a:29500", rdzv_id="77").command("par.train.job", ["--config", "configs/3d.json",
                                                                                   "--steps", "5"], torchrun=())
    assert started[started.index("torch.distributed.run") + 1:] == want


# ---------------------------------------------------------------- the placement lesson's formulas (no root)
def test_placements_put_the_other_axis_on_the_link():
    from par.train import placement
    assert placement.groups_of(4, 2) == {"node": [[0, 1], [2, 3]], "across": [[0, 2], [1, 3]]}
    assert placement.crossing("tp-in-node") == "dp" and placement.crossing("tp-across") == "tp"
    pred = placement.predictions("25mbit", placement.RECORDED_CALIBRATION)
    inside, across = pred["tp-in-node"], pred["tp-across"]      # {placement: typed prediction}
    assert inside.link_bytes == 2 * inside.dp_bytes and across.link_bytes == 2 * across.tp_bytes
    w = placement.workload()
    # 4 all-reduces per layer of one replica's activations b·s·d in fp32, 2(t-1)/t of it sent (t = 2)
    assert across.tp_bytes == 4 * w.model.n_layer * (128 // 2) * 64 * 16 * 4
    link = 25e6 / 8 / 2                                   # a host's link shared by its 2 ranks
    assert across.tp_s == pytest.approx(across.tp_bytes / link)
    assert across.step_s > 4 * inside.step_s              # the lesson: the link dominates when TP crosses it


def test_the_in_node_bandwidth_is_what_a_tp_step_gets_beyond_the_dense_one():
    from par.train.placement import node_bandwidth
    # 2 MB of TP all-reduces make a 0.10 s dense step take 0.15 s: 40 MB/s, below 100 MB/s back to back
    assert node_bandwidth(2e6, 0.15, 0.10, 100e6) == pytest.approx(40e6)
    # waits only slow all-reduces down: never above back to back, and back to back when no slower than dense
    assert node_bandwidth(2e6, 0.101, 0.10, 100e6) == 100e6
    assert node_bandwidth(2e6, 0.09, 0.10, 100e6) == 100e6


def test_without_root_the_cluster_says_why(monkeypatch):
    from par.runtime import cluster
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in cluster.missing()
    with pytest.raises(cluster.ClusterError, match="needs root"):
        cluster.Cluster(2)


# ---------------------------------------------------------------- the emulated cluster (root)
def cluster_or_skip():
    from par.runtime import cluster
    why = cluster.missing()
    if why and "binary is missing" in why and os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI runs the emulated cluster as root, but {why}")
    if why:
        pytest.skip(f"emulated cluster: {why}")
    return cluster


PREFIX = "parct"     # the tests' own namespaces: parct-<pid>-<n>-h0, ...


@pytest.fixture
def cluster():
    c = cluster_or_skip()
    c.cleanup_stale(PREFIX)                 # an earlier session killed before its teardown
    yield c
    left = [n for n in c.ours(PREFIX) if n.startswith(f"{PREFIX}-{os.getpid()}-")]
    assert left == [], f"namespaces left behind: {left}"


def test_two_hosts_train_equal_to_one_process(cluster, p2p_env):
    with cluster.Cluster(2, rate="1gbit", prefix=PREFIX) as c:
        assert len(c.created) == 3 and set(c.created) <= set(cluster.ours(PREFIX))   # two hosts, the switch
        r = c.run("par.train.job", ["--config", "configs/ddp.json", "--steps", "3", "--check"],
                  nproc_per_node=1, timeout=150, quiet=True, env=p2p_env)
    assert r["world_size"] == 2 and len(r["losses"]) == 3
    assert r["max_param_diff"] <= 1e-5, r["max_param_diff"]


def test_a_host_powered_off_mid_run_fails_the_job_naming_it(cluster):
    worker = str(ROOT / "tests" / "workers" / "cluster_steps.py")
    with cluster.Cluster(2, rate="1gbit", prefix=PREFIX) as c:
        with pytest.raises(cluster.ClusterError) as e:
            c.run(worker, ["300"], nproc_per_node=1, timeout=150, quiet=True, power_off=("h1", r"step 3\b"))
        failed_after = time.monotonic() - c.powered_off_at["h1"]
    head = e.value.root_cause
    assert head.startswith("host h1 (10.213.0.2) went down (powered off by SIGKILL)"), head
    assert failed_after < 60, f"the job failed {failed_after:.0f}s after h1 went down"


def test_nothing_is_left_when_building_fails(cluster):
    with pytest.raises(cluster.ClusterError, match="rate"):
        with cluster.Cluster(2, rate="fast", prefix=PREFIX):
            pass


def test_the_placement_lesson_trains_the_same_model_both_ways_and_counts_the_link(cluster):
    """Lecture 07b's measurement, once: both placements are the same TP2 x DP2 math (same losses), and the
    bytes the kernel counted on a host's link are the planner's and a little more (headers, barriers)."""
    from par.train import placement
    from par.measure import JobResult
    result = placement.measure(link="100mbit", steps=1, timeout=150, prefix=PREFIX)
    assert isinstance(result, JobResult)
    runs = {r.placement: r for r in result.runs}
    assert set(runs) == set(placement.PLACEMENTS)
    assert runs["tp-in-node"].losses == pytest.approx(runs["tp-across"].losses, abs=1e-5)
    cal = result.calibration
    assert 0 < cal.node_bytes_s <= cal.allreduce_bytes_s and cal.node_step_s > 0
    for row in placement.compare(result):
        # every payload byte crosses, plus TCP/IP headers, acks and the barriers' messages (most of a small step)
        assert row.predicted.link_bytes <= row.link_bytes <= 1.3 * row.predicted.link_bytes, row
        counted = row.counted.tp_bytes if row.crossing == "tp" else row.counted.dp_bytes
        assert counted == pytest.approx(row.predicted.tp_bytes if row.crossing == "tp" else row.predicted.dp_bytes,
                                        rel=1e-6), row
