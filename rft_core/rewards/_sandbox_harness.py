"""Runs one untrusted program inside the code-execution sandbox (``rft_core.rewards.code``).

Executed as a script (``python -I -B _sandbox_harness.py solution.py ALLOWED_JSON``) in a fresh
temporary working directory, under rlimits and (where possible) a network namespace set up by
the parent. Standard library only. Before the program runs, a PEP 578 audit hook (which cannot
be removed from Python code) refuses:

- opening files for writing outside the working directory, and for reading outside it and the
  interpreter's own prefixes (stdlib, site-packages);
- sockets, subprocesses, ``os.system``/``exec*``/``spawn*``/``fork``, signals to other
  processes, ``ctypes`` library loading;
- deleting, renaming, linking or changing files outside the working directory.

Exit codes: 0 passed, 1 the program raised, 2 syntax error, 3 the sandbox refused an
operation, 4 the program called exit, 5 out of memory. The last stderr line says why.
"""
import json
import os
import sys

_PROCESS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "os.kill", "os.killpg", "os.startfile", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
            "ctypes.call_function", "ctypes.addressof", "ctypes.cdata", "sys.setprofile", "sys.settrace",
            "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
            "socket.sendto", "socket.sendmsg", "urllib.Request", "webbrowser.open", "mmap.__new__",
            "os.setuid", "os.setgid", "os.chroot", "resource.setrlimit", "resource.prlimit"}
_PATH_WRITE = {"os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "os.mkdir", "os.symlink", "os.link",
               "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copytree",
               "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod"}
_PATH_READ = {"os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.walk"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SandboxViolation(Exception):
    """An operation the sandbox does not allow."""


def _inside(path, roots):
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _real(p):
    if isinstance(p, int):
        return None
    return os.path.realpath(os.fsdecode(p))


def _install_guard(workdir, readable):
    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            p = _real(path) if path is not None else None
            if p is None:
                return
            write = bool((flags or 0) & _WRITE_FLAGS) or any(c in (mode or "") for c in "wax+")
            if _inside(p, [workdir]) or (not write and _inside(p, readable)):
                return
            raise SandboxViolation(f"sandbox: open {p!r} for {'writing' if write else 'reading'} is not allowed")
        if event in _PROCESS or event.startswith("socket."):
            raise SandboxViolation(f"sandbox: {event} is not allowed")
        if event in _PATH_WRITE:
            for a in args:
                if isinstance(a, (str, bytes, os.PathLike)) and not _inside(_real(a), [workdir]):
                    raise SandboxViolation(f"sandbox: {event} on {_real(a)!r} is not allowed")
        elif event in _PATH_READ:
            for a in args[:1]:
                if isinstance(a, (str, bytes, os.PathLike)):
                    p = _real(a)
                    if not _inside(p, [workdir, *readable]):
                        raise SandboxViolation(f"sandbox: {event} on {p!r} is not allowed")

    sys.addaudithook(hook)


def main():
    program, readable = sys.argv[1], json.loads(sys.argv[2])
    workdir = os.path.realpath(os.getcwd())
    with open(program, encoding="utf-8") as fh:
        source = fh.read()
    exit_now = os._exit
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write(f"\nSyntaxError: {exc}\n")
        sys.stderr.flush()
        exit_now(2)
    import posix

    def refused(*_a, **_k):
        raise SandboxViolation("sandbox: os._exit is not allowed")

    os._exit = posix._exit = refused
    _install_guard(workdir, [os.path.realpath(r) for r in readable])
    status, why = 0, "passed"
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SandboxViolation as exc:
        status, why = 3, str(exc)
    except MemoryError:
        status, why = 5, "MemoryError: out of memory"
    except SystemExit as exc:
        status, why = 4, f"SystemExit: the program called exit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - any failure of the program is a failed test
        msg = str(exc).splitlines()[0][:300] if str(exc) else ""
        status, why = 1, f"{type(exc).__name__}: {msg}".rstrip(": ")
    try:
        sys.stdout.flush()
        sys.stderr.write(f"\n{why}\n")
        sys.stderr.flush()
    finally:
        exit_now(status)


if __name__ == "__main__":
    main()
