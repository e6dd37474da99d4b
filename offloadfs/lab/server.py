"""What every lab server process shares: start it (in a namespace or not), wait until it answers, fail loudly."""
import contextlib
import subprocess
import time

START_TIMEOUT = 10


class ServerProcess:
    """Subclasses give ``program``, ``command()``, ``answers()``, ``stop()``."""

    program = ""
    # The environment the program runs with (None: this process's).
    env = None

    def __init__(self, host, port, net, workdir, conf, log):
        """``conf`` and ``log``: file names in ``workdir``."""
        self.host = host
        self.port = port
        self.net = net
        self.workdir = workdir
        self.conf = workdir / conf
        self.log = workdir / log
        self.process = None

    def command(self):
        raise NotImplementedError

    def answers(self):
        raise NotImplementedError

    def stop(self):
        raise NotImplementedError

    @property
    def output(self):
        return self.workdir / f"{self.program}.out"

    def start(self):
        if self.answers():
            raise RuntimeError(f"something else already answers on {self.host}:{self.port}")
        # In a session of its own: smbd signals its whole process group when it exits.
        with open(self.output, "ab") as out:
            spawn = self.net.popen if self.net else lambda *cmd, **kw: subprocess.Popen(cmd, **kw)
            self.process = spawn(*self.command(), stdout=out, stderr=out, start_new_session=True,
                                 env=self.env)
        self.wait_ready()

    @contextlib.contextmanager
    def running(self):
        """Started here, stopped on the way out whatever happens; yields the server."""
        try:
            self.start()
            yield self
        finally:
            self.stop()

    def wait_ready(self):
        """Return once the server answers from the client side."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.fail(f"{self.program} exited with {self.process.returncode}")
            if self.answers():
                return
            time.sleep(0.01)
        self.fail(f"{self.program} not answering on {self.host}:{self.port} after {START_TIMEOUT} s")

    def fail(self, why):
        self.stop()
        tail = "".join(path.read_text(errors="replace")[-6000:] for path in (self.output, self.log) if path.exists())
        raise RuntimeError(f"{why}; end of its output and log:\n{tail}")

    def restart(self):
        """Start again (after kill() or while running) with the same configuration."""
        self.stop()
        self.start()
