"""Ranks for the verbs tests in the SoftRoCE guest, without torch.

Importing torch takes 30-80 s per process under TCG, so LocalCluster (which rendezvous
through torch's TCPStore) would spend most of the CI time importing. These ranks are forked
from a parent that has already imported numpy and ud_transport, and rendezvous through
DirectoryStore: a directory as a key-value store with the methods ud_transport's
rendezvous uses (set, get, check, wait, add). On the 9p share the rig mounts in both guests, the same
directory works across guests. Everything below the store is the production path:
Communicator, transports.open_transport, the verbs transport, the engine.
"""
import datetime
import multiprocessing
import os
import tempfile
import time
import traceback
import urllib.parse


class DirectoryStore:
    """set/get/wait over files in one directory (atomic by rename)."""

    def __init__(self, directory):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, key):
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    def set(self, key, value):
        data = value.encode() if isinstance(value, str) else bytes(value)
        # mkstemp, not a name from the pid: the two guests boot alike, so rank 0 and rank 2 can
        # have the same pid, and both closing a round at once then shared one temporary file (the
        # second os.replace found it gone; CI failed on it once). O_EXCL is decided on the host.
        descriptor, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        os.replace(temporary, self._path(key))

    def get(self, key):
        with open(self._path(key), "rb") as source:
            return source.read()

    def add(self, key, amount):
        """1 only (what the rendezvous adds): the value is the first n whose file `key#n` this
        call creates. O_EXCL is decided by the host's file system, so across guests on the 9p
        share too, where a lock taken in one guest is not seen in the other."""
        if amount != 1:
            raise NotImplementedError("DirectoryStore.add counts by one")
        n = 1
        while True:
            try:
                os.close(os.open(self._path(f"{key}#{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                return n
            except FileExistsError:
                n += 1

    def check(self, keys):
        return all(os.path.exists(self._path(k)) for k in keys)

    def wait(self, keys, timeout=datetime.timedelta(seconds=300)):
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        deadline = time.monotonic() + seconds
        while not all(os.path.exists(self._path(k)) for k in keys):
            if time.monotonic() > deadline:
                missing = [k for k in keys if not os.path.exists(self._path(k))]
                raise TimeoutError(f"store keys not set within {seconds:.0f} s: {missing}")
            time.sleep(0.01)


def _rank_main(rank, world_size, store_directory, init_options, function, arguments, connection):
    try:
        import ud_transport
        from ud_transport import options

        store = DirectoryStore(store_directory)
        with ud_transport.Communicator(rank, world_size, store, init_options.pop("transport", "verbs"),
                                       options.build(**init_options)) as comm:
            comm.store = store
            connection.send(("ok", function(comm, *arguments)))
    except BaseException as error:  # report, never hang the parent
        connection.send(("error", f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        connection.close()


def run_ranks(ranks, world_size, store_directory, function, *arguments, timeout_s=600, dying=(), **init_options):
    """Run function(comm, *arguments) on `ranks` (of world_size), each a forked process with
    its own Communicator; returns their results in order, or raises with every rank's error.
    `dying`: ranks that are meant to kill themselves; their result is None, and one that lives
    to send a result is an error."""
    context = multiprocessing.get_context("fork")
    children = []
    for rank in ranks:
        parent, child = context.Pipe(duplex=False)
        process = context.Process(target=_rank_main, daemon=True,
                                  args=(rank, world_size, store_directory, dict(init_options), function, arguments, child))
        process.start()
        child.close()
        children.append((rank, process, parent))
    results, errors = [], []
    deadline = time.monotonic() + timeout_s
    for rank, process, connection in children:
        if connection.poll(max(deadline - time.monotonic(), 0)):
            try:
                status, value = connection.recv()
                if rank in dying:
                    status, value = "error", f"rank {rank}: meant to die, it sent {status}: {value}"
            except EOFError:
                process.join(5)
                status, value = ("ok", None) if rank in dying and process.exitcode == -9 else \
                    ("error", f"rank {rank}: exited with status {process.exitcode} without a result")
        else:
            status, value = "error", f"rank {rank}: no result within {timeout_s} s"
        (results if status == "ok" else errors).append(value)
    for _, process, _ in children:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
