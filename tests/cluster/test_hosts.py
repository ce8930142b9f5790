"""The test cluster's hosts are separate hosts: what MPI, Slurm and hpcdl use to tell hosts
apart differs on each (hostname, boot id, /tmp, /dev/shm, eth0), and the shared directory is
the same on all of them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from cluster_hosts import SCRIPT, cannot_make_hosts


def test_every_host_has_its_own_name_boot_id_and_address(cluster):
    seen = {}
    for host in cluster.hosts:
        out = cluster.run(host, "hostname; cat /proc/sys/kernel/random/boot_id; "
                                "ip -o -4 addr show eth0", check=True).stdout.split("\n")
        seen[host] = (out[0], out[1], out[2].split()[3])
    assert [name for name, _, _ in seen.values()] == cluster.hosts
    assert len({boot for _, boot, _ in seen.values()}) == len(cluster.hosts)
    assert [addr for _, _, addr in seen.values()] == [f"10.99.0.{i + 1}/24"
                                                      for i in range(len(cluster.hosts))]


def test_tmp_and_dev_shm_are_node_local_and_the_shared_directory_is_shared(cluster):
    marker = cluster.workdir("marker")
    for host in cluster.hosts:
        cluster.run(host, f"touch /tmp/only-on-{host} /dev/shm/only-on-{host} "
                          f"{marker}/written-by-{host}", check=True)
    for host in cluster.hosts:
        assert f"only-on-{host}" in cluster.listing(host, "/tmp")
        assert [f for f in cluster.listing(host, "/tmp") if f.startswith("only-on-")] == \
            [f"only-on-{host}"]
        assert [f for f in cluster.listing(host, "/dev/shm") if f.startswith("only-on-")] == \
            [f"only-on-{host}"]
        assert cluster.listing(host, str(marker)) == sorted(f"written-by-{h}"
                                                            for h in cluster.hosts)
    for host in cluster.hosts:
        cluster.run(host, f"rm -f /tmp/only-on-{host} /dev/shm/only-on-{host}", check=True)


def send(cluster, payload: int, port: int) -> None:
    """``payload`` bytes from h1 to h2 over TCP; h2 checks it received them all."""
    server = (f"python3 -c \"import socket; s=socket.create_server(('10.99.0.2', {port})); "
              "c,_=s.accept(); n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nprint(n)\"")
    client = (f"python3 -c \"import socket,time; time.sleep(1); "
              f"c=socket.create_connection(('h2', {port})); c.sendall(bytes({payload})); "
              "c.close()\"")
    receiver = subprocess.Popen([str(cluster.ssh), "h2", server], stdout=subprocess.PIPE,
                                text=True, env=cluster.env())
    cluster.run("h1", client, check=True, timeout=60)
    assert receiver.communicate(timeout=60)[0].strip() == str(payload)


def test_traffic_between_hosts_crosses_both_eth0s(cluster):
    payload = 4 * 2**20
    rx0, _ = cluster.eth0_bytes("h2")
    _, tx0 = cluster.eth0_bytes("h1")
    send(cluster, payload, 7777)
    rx1, _ = cluster.eth0_bytes("h2")
    _, tx1 = cluster.eth0_bytes("h1")
    assert rx1 - rx0 >= payload and tx1 - tx0 >= payload
    assert cluster.listing("h1", "/sys/class/net") == ["eth0", "lo"]


def test_a_shaped_link_holds_packets_back(cluster):
    """tbf's overlimits counter rises only when the bucket held a packet back: proof, without
    a clock, that a shaped link is slower than the data offered to it."""
    cluster.script("shape", "h1", "20mbit")
    try:
        send(cluster, 2 * 2**20, 7778)
        stats = cluster.run("h1", "tc -s qdisc show dev eth0", check=True).stdout
        assert "tbf" in stats
        overlimits = int(stats.split("overlimits")[1].split()[0])
        assert overlimits > 0, stats
    finally:
        cluster.script("shape", "h1", "off")


def test_a_checkout_and_interpreter_under_tmp_are_visible_on_every_host(tmp_path):
    """A clone under /tmp (here: cluster.sh copied into one) and a virtual environment under
    /tmp on PATH: every host of a cluster that clone brings up sees both at their own paths,
    and its /tmp stays its own otherwise. (The session's cluster covers a checkout elsewhere.)"""
    reason = cannot_make_hosts()
    if reason:
        pytest.skip(reason)
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    (clone / "tests" / "cluster").mkdir(parents=True)
    shutil.copy2(SCRIPT, clone / "tests" / "cluster" / "cluster.sh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True, timeout=120)
    (tmp_path / "only-in-the-root-namespace").touch()
    script = clone / "tests" / "cluster" / "cluster.sh"
    env = {**os.environ, "HPCDL_CLUSTER_DIR": f"/var/tmp/hpcdl-clone-test-{os.getpid()}",
           "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}

    def call(*args: str) -> str:
        done = subprocess.run([str(script), *args], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == 0, f"cluster.sh {' '.join(args)}: {done.stdout}{done.stderr}"
        return done.stdout

    try:
        call("up", "2")
        for host in ("h1", "h2"):
            seen = call("exec", host, "bash", "-c",
                        f"cd {clone} && ls tests/cluster && python3 -c 'import sys; "
                        f"print(sys.prefix)' && ls {tmp_path}")
            assert seen.split() == ["cluster.sh", str(venv), "clone", "venv"], seen
    finally:
        call("down")
        shutil.rmtree(env["HPCDL_CLUSTER_DIR"], ignore_errors=True)
