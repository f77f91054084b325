"""A seccomp filter for the code's process: no new programs, no namespaces, no kernel admin.

Imported by ``_sandbox_code.py`` (standard library only). `install` loads a classic-BPF program
with ``prctl(PR_SET_SECCOMP)``; it holds for the process and every child it forks, and unlike
an audit hook it cannot be bypassed from native code (``_posixsubprocess.fork_exec``, ctypes).
Refused system calls fail with EPERM (``PermissionError`` in Python): ``execve``/``execveat``
(no program but this interpreter ever runs), ``clone`` with a namespace flag, ``unshare``,
``setns``, mounts, ``ptrace``, ``process_vm_*``, ``bpf``, ``perf_event_open``,
``userfaultfd``, ``io_uring_*``, keyrings, modules, ``kexec``, ``reboot``, swap, clocks and host
names. ``socket``/``socketpair`` accept only ``AF_UNIX``, ``AF_INET`` and ``AF_INET6``: any other
family (``AF_VSOCK``, which the network namespace does not cover and which reaches a VM's host,
``AF_NETLINK``, ``AF_PACKET``, ...) fails with EAFNOSUPPORT. ``clone3`` answers ENOSYS, so the C
library falls back to ``clone``, whose flags the filter can read. A call from another
architecture's ABI (x32, i386 on x86_64) kills the process.
"""

import os

SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
EPERM, ENOSYS, EAFNOSUPPORT = 1, 38, 97
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10  # the only socket families the code may open
# BPF opcodes: load word at absolute offset, jump if equal / if any bit set / if >=, return constant
LD_ABS, JEQ, JSET, JGE, RET = 0x20, 0x15, 0x45, 0x35, 0x06
OFFSET_NR, OFFSET_ARCH, OFFSET_ARG0_LOW = 0, 4, 16  # struct seccomp_data, little-endian (arg0 is an int)

CLONE_NEW_ANY = (0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000  # time, ns, cgroup, uts, ipc
                 | 0x10000000 | 0x20000000 | 0x40000000)  # user, pid, net

_DENIED = ("execve", "execveat", "ptrace", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
           "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "kexec_load",
           "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
           "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
           "process_vm_readv", "process_vm_writev", "open_by_handle_at", "name_to_handle_at", "open_tree",
           "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "io_uring_setup",
           "io_uring_enter", "io_uring_register", "syslog", "quotactl", "vhangup", "fanotify_init", "iopl", "ioperm")

# (audit arch, syscall numbers, lowest number of a foreign ABI sharing this arch or None)
_ARCHES = {
    "x86_64": (0xC000003E, 0x40000000, {
        "execve": 59, "execveat": 322, "ptrace": 101, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "unshare": 272, "setns": 308, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
        "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170,
        "setdomainname": 171, "process_vm_readv": 310, "process_vm_writev": 311, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "syslog": 103, "quotactl": 179, "vhangup": 153, "fanotify_init": 300,
        "iopl": 172, "ioperm": 173, "clone": 56, "clone3": 435, "socket": 41, "socketpair": 53}),
    "aarch64": (0xC00000B7, None, {
        "execve": 221, "execveat": 281, "ptrace": 117, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "unshare": 97, "setns": 268, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
        "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161,
        "setdomainname": 162, "process_vm_readv": 270, "process_vm_writev": 271, "open_by_handle_at": 265,
        "name_to_handle_at": 264, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "syslog": 116, "quotactl": 60, "vhangup": 58, "fanotify_init": 262,
        "clone": 220, "clone3": 435, "socket": 198, "socketpair": 199}),
}


def supported():
    return os.uname().machine in _ARCHES


def program():
    """The filter as a list of (code, jt, jf, k) instructions for this machine."""
    arch, foreign_abi, numbers = _ARCHES[os.uname().machine]
    kill, allow = SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ALLOW
    prog = [(LD_ABS, 0, 0, OFFSET_ARCH), (JEQ, 1, 0, arch), (RET, 0, 0, kill), (LD_ABS, 0, 0, OFFSET_NR)]
    if foreign_abi is not None:
        prog += [(JGE, 0, 1, foreign_abi), (RET, 0, 0, kill)]
    for name in _DENIED:
        if name in numbers:
            prog += [(JEQ, 0, 1, numbers[name]), (RET, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    for name in ("socket", "socketpair"):  # the family (arg 0) must be one of three
        prog += [(JEQ, 0, 6, numbers[name]), (LD_ABS, 0, 0, OFFSET_ARG0_LOW),
                 (JEQ, 3, 0, AF_UNIX), (JEQ, 2, 0, AF_INET), (JEQ, 1, 0, AF_INET6),
                 (RET, 0, 0, SECCOMP_RET_ERRNO | EAFNOSUPPORT), (RET, 0, 0, allow)]
    prog += [(JEQ, 0, 1, numbers["clone3"]), (RET, 0, 0, SECCOMP_RET_ERRNO | ENOSYS)]
    prog += [(JEQ, 0, 3, numbers["clone"]), (LD_ABS, 0, 0, OFFSET_ARG0_LOW),
             (JSET, 0, 1, CLONE_NEW_ANY), (RET, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    prog.append((RET, 0, 0, allow))
    return prog


def install(libc):
    """Load the filter into this process (needs no_new_privs or CAP_SYS_ADMIN). Raises OSError."""
    import ctypes

    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Instruction))]

    instructions = program()
    array = (Instruction * len(instructions))(*(Instruction(*i) for i in instructions))
    prog = Program(len(instructions), array)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp: {os.strerror(err)}")
