"""Run N ranks as local processes, for the demo, the benchmark and the tests.

Scale-out launching is torchrun's job; this only starts ranks on one machine
(optionally inside a network namespace) and runs functions on all of them:

    with LocalCluster(4, chunk_bytes=256) as cluster:
        results = cluster.run(some_module.task, argument)   # task(comm, argument) on every rank
"""
import ctypes
import multiprocessing
import os
import socket
import traceback

CLONE_NEWNET = 0x40000000


class RankFailed(RuntimeError):
    def __init__(self, rank, error, remote_traceback):
        super().__init__(f"rank {rank} raised {type(error).__name__}: {error}\n{remote_traceback}")
        self.rank = rank
        self.error = error


def free_tcp_port(host="127.0.0.1"):
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def enter_network_namespace(name):
    """Move this (still single-threaded) process into /var/run/netns/<name>."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns({name}) failed: {os.strerror(error)}")
    finally:
        os.close(fd)


def _worker(rank, world_size, port, netns, environment, init_options, connection, store_host="127.0.0.1", log_level=None):
    if netns:
        enter_network_namespace(netns)  # before any thread or socket exists
    os.environ.update(environment)
    if log_level is not None:
        import logging

        logging.basicConfig(level=log_level, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    try:
        import torch.distributed as dist

        import ud_transport

        store = dist.TCPStore(store_host, port, world_size, is_master=(rank == 0))
        comm = ud_transport.init(rank, world_size, store=store, **init_options)
    except BaseException as error:  # report, do not hang the parent
        connection.send(("error", error, traceback.format_exc()))
        return
    connection.send(("ready", None, ""))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            break
        if message is None:
            break
        function, arguments = message
        try:
            connection.send(("ok", function(comm, *arguments), ""))
        except BaseException as error:
            connection.send(("error", error, traceback.format_exc()))
    comm.close()


class LocalCluster:
    def __init__(self, world_size, *, netns=None, environment=None, start_timeout_s=120, store_port=None, hosts=None,
                 log_level=None, **init_options):
        """hosts: a ud_transport.lab.hosts.Hosts with a host per rank; rank r then runs in hosts.namespaces[r]
        with hosts.rank_environment(r) (store on host 0, its own bind address), instead of `netns`.
        log_level: ranks log to their stderr at this level ("WARNING", ...), each line naming its rank."""
        self.world_size = world_size
        context = multiprocessing.get_context("spawn")
        port = store_port or free_tcp_port()
        self.connections, self.processes = [], []
        for rank in range(world_size):
            parent, child = context.Pipe()
            rank_netns, rank_environment, store_host = netns, dict(environment or {}), "127.0.0.1"
            if hosts is not None:
                rank_netns, store_host = hosts.namespaces[rank], hosts.addresses[0]
                rank_environment.update(hosts.rank_environment(rank))
            process = context.Process(target=_worker, args=(rank, world_size, port, rank_netns, rank_environment, init_options, child,
                                                            store_host, log_level),
                                      daemon=True, name=f"ud_transport-rank{rank}")
            process.start()
            child.close()
            self.connections.append(parent)
            self.processes.append(process)
        try:
            self._collect(range(world_size), start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _collect(self, ranks, timeout_s, return_exceptions=False):
        results = []
        for rank in ranks:
            connection = self.connections[rank]
            if not connection.poll(timeout_s):
                raise TimeoutError(f"rank {rank} did not answer within {timeout_s} s")
            status, value, remote_traceback = connection.recv()
            if status == "error":
                if not return_exceptions:
                    raise RankFailed(rank, value, remote_traceback)
                results.append(value)
            else:
                results.append(value)
        return results

    def run(self, function, *arguments, timeout_s=300, ranks=None, return_exceptions=False):
        """Call function(comm, *arguments) on every rank (or `ranks`) and return the results in rank order."""
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        for rank in ranks:
            self.connections[rank].send((function, arguments))
        return self._collect(ranks, timeout_s, return_exceptions)

    def kill(self, rank):
        """Stop one rank abruptly, as a crashed process would."""
        self.processes[rank].kill()
        self.processes[rank].join(10)

    def close(self):
        for connection, process in zip(self.connections, self.processes):
            try:
                if process.is_alive():
                    connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.processes = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
