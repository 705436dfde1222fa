"""Placement across hosts: layouts the config refuses, the worker's address rules, the SLURM
request Monarch submits for a config, and a training run across two TLS `meshrl worker` processes
on 127.0.0.1 (each one a host) with the trainer mesh spanning both."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest
import torch
from e2e import ENV, LOSS_SWAPS, MESHRL, REPO, SMALL, assert_loss_swap, free_address, lose_host, records, start_worker

from meshrl.configs import ConfigError, load_config
from meshrl.topology.devices import cpu_threads, proc_device, role_gpus
from meshrl.topology.worker import check_address, tls_env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology.trainer.hosts", "2"], "topology.trainer.hosts = 2 but mode 'local' is this one host"),
        (["--topology.mode", "attach"], "needs at least one address in topology.workers"),
        (["--topology.mode", "attach", "--topology.workers", '["tcp://127.0.0.1:1"]', "--topology.generator.hosts", "2"],
         "topology.generator.hosts = 2 but topology.workers offers 1 host(s)"),
        (["--topology.workers", '["tcp://a:1", "tls://b:1"]'], "mixes tcp:// and tls://"),
        (["--topology.workers", '["tls://a:1"]'], "tls:// workers need topology.tls.cert"),
        (["--topology.workers", '["udp://a:1"]'], "must start with tcp:// or tls://"),
    ],
)  # fmt: skip
def test_impossible_layouts_are_refused_with_the_reason(args, message):
    with pytest.raises(ConfigError, match="topology") as info:
        load_config(args)
    assert message in str(info.value)


def test_plain_tcp_workers_stay_on_loopback_unless_asked():
    check_address("tcp://127.0.0.1:26600")
    check_address("tls://10.0.0.5:26600")  # authenticated by certificates
    with pytest.raises(ValueError, match="neither encrypts nor authenticates"):
        check_address("tcp://0.0.0.0:26600")
    with pytest.raises(ValueError, match="neither encrypts nor authenticates"):
        check_address("tcp://node1:26600@tcp://0.0.0.0:26600")  # the bind half decides
    check_address("tcp://0.0.0.0:26600", allow_remote_tcp=True)
    with pytest.raises(ValueError, match="must look like"):
        check_address("127.0.0.1:26600")


def test_worker_command_refuses_a_public_tcp_bind_and_a_tls_worker_without_certificates():
    public = subprocess.run([*MESHRL, "worker", "--address", "tcp://0.0.0.0:26600"], capture_output=True, text=True)
    assert public.returncode == 2 and "--allow-remote-tcp" in public.stderr
    tls = subprocess.run([*MESHRL, "worker", "--address", "tls://127.0.0.1:26600"], capture_output=True, text=True)
    assert tls.returncode == 2 and "--tls-cert, --tls-key, --tls-ca" in tls.stderr


def test_tls_files_reach_monarch_through_its_environment():
    config = load_config(["--topology.tls.cert", "c.pem", "--topology.tls.key", "k.pem", "--topology.tls.ca", "ca.pem"])
    assert tls_env(config.topology.tls.cert, config.topology.tls.key, config.topology.tls.ca) == {
        "HYPERACTOR_TLS_CERT": "c.pem", "HYPERACTOR_TLS_KEY": "k.pem", "HYPERACTOR_TLS_CA": "ca.pem",
    }  # fmt: skip


SUBMIT = (
    "import sys; from meshrl.configs import load_config; from meshrl.topology.placement import slurm_job; "
    "slurm_job(load_config(sys.argv[1:]).topology).apply()"
)


def test_slurm_request_from_the_config(tmp_path):
    """Monarch's SlurmJob submits through `sbatch`; a stand-in on PATH records what it is sent.
    (In its own process: SlurmJob switches the process's Monarch transport to tcp.)"""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ncat > {tmp_path / 'request.sh'}\necho 'Submitted batch job 4242'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        [sys.executable, "-c", SUBMIT,"--topology.mode", "slurm", "--topology.trainer.hosts", "2", "--topology.trainer.procs", "4",
         "--topology.trainer.gpus-per-proc", "2", "--topology.generator.hosts", "3",
         "--topology.generator.gpus-per-proc", "1",
         "--topology.slurm.partition", "gpu", "--topology.slurm.time-limit", "04:00:00",
         "--topology.slurm.account", "rl", "--topology.slurm.python-exe", "/opt/venv/bin/python",
         "--topology.slurm.log-dir", str(tmp_path / "logs"), "--topology.slurm.sbatch-args", '["--mem=64G"]'],
        env=env, check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    request = (tmp_path / "request.sh").read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=9",  # 4 x 2 trainer + 1 generator GPU "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "#SBATCH --account=rl", "#SBATCH --mem=64G"):  # fmt: skip
        assert line in request.splitlines(), line
    assert "srun /opt/venv/bin/python" in request


@pytest.mark.network
def test_a_worker_is_reachable_only_while_its_port_listens():
    from meshrl.topology.faults import worker_reachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert worker_reachable(f"tls://127.0.0.1:{port}")
        assert worker_reachable(f"tcp://127.0.0.1:{port}@tcp://0.0.0.0:{port}")  # dial@bind: the dial part
    assert not worker_reachable(f"tcp://127.0.0.1:{port}", timeout_s=1.0)


def _certificates(directory, ca_name: str, names: list[str]) -> dict[str, list[str]]:
    """A CA and, per name, a certificate it signs for 127.0.0.1: {name: [cert, key, ca]} PEM paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, key, issuer: str, signer, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(signer, hashes.SHA256())

    def write(path, data: bytes) -> str:
        path.write_bytes(data)
        return str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = build(ca_name, ca_key, ca_name, ca_key, ca=True)
    ca_path = write(directory / f"{ca_name}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
    files = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = build(name, key, ca_name, ca_key, ca=False)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        files[name] = [write(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
                       write(directory / f"{name}.key", key_pem), ca_path]  # fmt: skip
    return files


@pytest.mark.mesh
@pytest.mark.network
def test_tls_mesh_across_two_hosts_trains_and_refuses_a_controller_from_another_ca(tmp_path):
    """Two `meshrl worker` hosts on tls://: the trainer mesh (FSDP2) spans both, the other roles run on
    the first, and the run trains with IPO (a loss swap, tests/e2e.py). A controller whose certificate
    another CA signed is refused, and the workers live on."""
    certs = _certificates(tmp_path, "mesh-ca", ["worker0", "worker1", "controller"])
    rogue = _certificates(tmp_path, "other-ca", ["rogue"])["rogue"]
    addresses = [free_address("tls") for _ in range(2)]
    workers = [start_worker(a, *(f"--tls-{k}={v}" for k, v in zip(("cert", "key", "ca"), certs[f"worker{i}"])))
               for i, a in enumerate(addresses)]  # fmt: skip
    base = [*MESHRL, "train", *SMALL, "--topology.mode", "attach", "--topology.workers", json.dumps(addresses),
            "--teachers.members", "[]"]  # fmt: skip

    def controller(out, cert: list[str], attach_timeout_s: int, *extra: str) -> subprocess.CompletedProcess:
        tls = [f"--topology.tls.{k}={v}" for k, v in zip(("cert", "key", "ca"), cert)]
        return subprocess.run([*base, "--output-dir", str(out), *tls, "--topology.attach_timeout_s",
                               str(attach_timeout_s), *extra], capture_output=True, text=True, timeout=240, cwd=REPO,
                              env=ENV)  # fmt: skip

    try:
        out = tmp_path / "trusted"
        trusted = controller(out, certs["controller"], 30, "--max-steps", "2", "--topology.trainer.hosts", "2",
                             "--trainer.parallelism", "fsdp2", *LOSS_SWAPS["ipo"])  # fmt: skip
        assert trusted.returncode == 0, trusted.stderr[-3000:]
        assert [r["step"] for r in records(out)] == [0, 1]
        assert_loss_swap(out, "ipo")
        actors = json.loads((out / "topology.json").read_text())["actors"]
        trainers = sorted((a["rank"], a["worker"]) for a in actors if a["role"] == "trainer")
        assert trainers == [(0, addresses[0]), (1, addresses[1])]  # one trainer rank per host
        assert {a["worker"] for a in actors if a["role"] != "trainer"} == {addresses[0]}
        assert all(w.poll() is None for w in workers)  # the run frees its meshes; workers stay up
        # A refused handshake looks like a worker that never answers: the attach times out.
        refused = controller(tmp_path / "refused", rogue, 3, "--max-steps", "1")
        assert refused.returncode != 0
        assert f"could not attach to topology.workers {addresses}" in refused.stderr
        assert all(w.poll() is None for w in workers)  # the workers turned the stranger away and live on
    finally:
        for w in workers:
            lose_host(w)


def test_roles_take_consecutive_gpu_ranges_on_each_host():
    config = load_config(["--topology.generator.procs", "2", "--topology.generator.gpus_per_proc", "1",
                          "--topology.trainer.procs", "2", "--topology.trainer.gpus_per_proc", "2",
                          "--topology.generator.hosts", "2", "--topology.mode", "attach",
                          "--topology.workers", '["tcp://a:1", "tcp://b:1"]'])  # fmt: skip
    topology = config.topology
    assert [role_gpus(topology, "generator", rank) for rank in range(4)] == [[0], [1], [0], [1]]  # hosts-major
    assert [role_gpus(topology, "trainer", rank) for rank in range(2)] == [[2, 3], [4, 5]]
    assert role_gpus(topology, "teacher", 0) == []
    assert proc_device(topology, "teacher", 0) == torch.device("cpu")
    if torch.cuda.device_count() < 6:
        with pytest.raises(RuntimeError, match=r"topology.trainer.gpus_per_proc: trainer rank 1 needs GPUs \[4, 5\]"):
            proc_device(topology, "trainer", 1)


def test_vllm_generators_run_on_one_gpu_each_or_on_the_cpu():
    with pytest.raises(ConfigError, match=r"gpus_per_proc = 1 \(vLLM's GPU build\) or 0 \(its CPU build\), got 2"):
        load_config(["--generator.backend", "vllm", "--topology.generator.gpus_per_proc", "2"])
    assert load_config(["--generator.backend", "vllm", "--topology.generator.gpus_per_proc", "1"])
    assert load_config(["--generator.backend", "vllm"])  # the CPU build


def test_cpu_processes_take_every_core_and_their_idle_openmp_workers_sleep(monkeypatch):
    """Generator and trainer share a host's cores by taking turns: each process uses them all,
    and every process `meshrl` starts inherits OMP_WAIT_POLICY=PASSIVE (spinning idle workers
    would slow the other process several-fold)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_threads() == 8
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    probe = "import os, meshrl.cli.main; print(os.environ['OMP_WAIT_POLICY'])"
    shown = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.strip() == "PASSIVE"
