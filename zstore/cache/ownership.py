"""Who may write a tier: its user only, or, opted in, one group.

A value planted in a tier directory is read back as training data (the key carries
only the store id, which anyone who can read the store knows; crc32c guards against
accidents, not against a writer).  So a tier directory is used only when nobody else
can write into it:

- private (the default): owned by this user, not writable by group or others; zstore
  creates its directories ``0700`` and its files ``0600``;
- shared with a group (``CacheConfig(shared_group=...)``): owned by that group,
  setgid, not writable by others, and owned by you, root or a member of the group as
  the system's databases say (``getent group``): a directory made by someone who has
  since left the group is refused.  Directories ``2770``, files ``0660``.  Every member
  of the group can then feed every other member's training.

A directory that fails the check is refused with one warning naming it, its owner and
its mode; reads go to the next tier or the origin.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
GROUP_DIR, GROUP_FILE = 0o2770, 0o660


def group_id(value: str | int) -> int:
    """A group's id from its name or number."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    return grp.getgrnam(str(value)).gr_gid


def describe(path: str) -> str:
    """'owner alice, group speech, mode 2770' (or why it cannot be read)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    return (
        f"owner {_user(st.st_uid)}, group {_group(st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"
    )


def problem(path: str, gid: int | None) -> str | None:
    """Why ``path`` must not hold a tier (None: it may)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (use the real directory)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    if gid is None:
        if st.st_uid != os.geteuid():
            return f"belongs to {_user(st.st_uid)}, not to you ({_user(os.geteuid())})"
        if mode & 0o022:
            return "can be written by group or others (mode {:04o}; want 0700)".format(mode)
        return None
    if st.st_gid != gid:
        return f"belongs to group {_group(st.st_gid)}, not to the shared group {_group(gid)}"
    if mode & 0o002:
        return "can be written by anyone (mode {:04o}; want 2770)".format(mode)
    if gid != os.getegid() and gid not in os.getgroups():
        return f"is shared with group {_group(gid)}, which you are not in"
    if st.st_uid not in (os.geteuid(), 0) and not is_member(st.st_uid, gid):
        return (
            f"belongs to {_user(st.st_uid)}, who is not in the shared group "
            f"{_group(gid)} (a former member could have written anything there); "
            "have the directory removed, or recreated by a member"
        )
    return None


def is_member(uid: int, gid: int) -> bool:
    """Whether the system's user and group databases put user ``uid`` in group ``gid``
    (its primary group, or listed as a member).  A user or group the databases do not
    know is no member: nothing vouches for it."""
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid or user.pw_name in group.gr_mem


def shared_gid(path: str) -> int | None:
    """The group a directory is shared with (setgid bit set), else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_gid if st.st_mode & stat.S_ISGID else None


def make_dir(path: str, gid: int | None = None) -> str | None:
    """Create ``path`` (and missing parents) for a tier, then check it; the problem
    with it, or None.  ``gid`` None: inherit the parent's sharing (setgid) if any."""
    if gid is None:
        gid = shared_gid(os.path.dirname(os.path.abspath(path)))
    try:
        os.makedirs(path, mode=PRIVATE_DIR if gid is None else GROUP_DIR, exist_ok=False)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, PRIVATE_DIR if gid is None else GROUP_DIR)  # past the umask
    except FileExistsError:
        pass
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    return problem(path, gid)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"
