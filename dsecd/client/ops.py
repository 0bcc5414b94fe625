"""What the SDK knows of each request type: which are sent again after a
lost connection (they change nothing, are idempotent or keyed), which
settle when abandoned, which follow; what a loss leaves open of one; its
idempotency key; the error a daemon answered it with.
"""

from __future__ import annotations

import dataclasses
import secrets

from .. import protocol
from ..errors import DsecError

# Requests whose abandonment (a cancel, a timeout) waits for their final
# frame, as a create's does: an exec's comes once the daemon no longer
# counts it as running (a destroy without force right after is not refused
# for it); a directory copy's once the daemon has removed its partial
# tree; a remove's once it has stopped; a snapshot's once its pack has ended unpublished and the sandbox
# is thawed; a pause's or resume's (of a sandbox or a job: once begun, they
# finish) once it has, so that the next request is not overtaken by its
# freeze or thaw; a background process's may say it was started (the
# daemon was done before the cancel landed), and it is then killed. So the
# caller's cancel returns with nothing of it left or under way. Waited for
# ABANDONED_CREATE_WAIT_S (wire.py) at most (close() waits for the rest).
SETTLED_WHEN_ABANDONED = ("exec", "file_tar_put", "file_remove", "proc_start", "snapshot", "pause", "resume",
                          "job_pause", "job_resume")
# Requests that only read (file ops resume a paused sandbox, memory.auto_resume:
# sent again, they find it running): one whose connection was lost after it
# was sent is sent again, once, on the next connection (reconnect=True), as
# one never sent is, so that a Process.wait() or an inspect outlives a daemon
# restart. Those that stream what they read (FOLLOWS_ONLY) are not: what came
# before the loss would come again; their error says they are safe to send again.
CHANGES_NOTHING = ("ping", "info", "image_du", "image_list", "image_inspect", "policy_list", "top", "list",
                   "inspect", "proc_list", "proc_wait", "file_read", "file_list", "file_stat", "net_show",
                   "net_sets", "pool_list")
FOLLOWS_ONLY = ("proc_logs", "events", "file_watch", "file_tar_get")
# Requests that change something, but whose second run changes nothing more
# (the daemon's pause of a paused sandbox, resume of a running one; a renew
# sets each lease to end `lease` from now, as a renew made then would):
# sent again, once, as those that only read are, the sandbox ends as asked.
# So Client.hold's renew in flight at a daemon restart renews on the next
# daemon instead of failing.
IDEMPOTENT = ("pause", "resume", "renew")
# Requests the daemon takes an idempotency key for (an exec without stdin
# or pty): one lost after it was sent goes again, once, with its key, and
# the daemon answers it with what the first one did (a create's sandbox, an
# exec's result, the process started, the image made) instead of doing it
# twice; a streamed exec goes again after each loss a frame came before,
# taking its output up where it stopped (frames_with_id). The SDK gives
# each one a key of its own (_made_key) where the daemon takes them: a
# create always, the others where its hello lists "op.keys" (a streamed
# exec: "op.keys.stream"), an exec over ssh:// only (Client.key_execs).
KEYED = ("create", "exec", "proc_start", "snapshot")
# Of those, ones whose frames before the result are progress only: the
# request sent again streams the progress of the one under way from there
# on (the daemon sends it to every request of the key waiting), so they
# tell nothing false.
PROGRESS_FRAMES = ("snapshot",)


def lost_after_sending(op: str, key: str | None = None) -> str:
    """What a connection lost after `op` was sent leaves open, for its error;
    `key`: its idempotency key, if it was sent with one."""
    if op == "create":
        return "; the create may have been carried out (sent again with the same idempotency key, it is safe)"
    if key and op in KEYED:
        return (f"; the request may have been carried out, and runs on if it was: sent again with its "
                f"idempotency key {key!r} (key={key!r}), it is answered with what it did, or waits for it, "
                "instead of running again")
    if op in CHANGES_NOTHING or op in FOLLOWS_ONLY:
        return "; it changes nothing, so it is safe to send again"
    if op in IDEMPOTENT:
        return "; it may have been carried out, and is safe to send again (done twice, it is done once)"
    if op == "exec":
        # The daemon kills the execs of a connection that ends, and the next
        # daemon those of one that died: none outlives its connection.
        return ("; the request may have been carried out: the command may have run, in part, and no longer "
                "runs (the daemon kills the execs of a connection that ends; a background process, "
                "spawn or dsec exec -d, outlives it)")
    return "; the request may have been carried out"


def _made_key() -> str:
    """An idempotency key for a create (or an exec, proc_start or snapshot:
    KEYED) given none. The daemon answers a request of a key it has seen
    with what that key's request did, so the SDK may send such a request
    again after losing its connection (a daemon restart, an ssh:// link
    cut) without doing it twice; without a key, a create whose answer was
    lost leaves a sandbox nobody knows the id of, and an exec's command may
    have run, or not."""
    return f"sdk-{secrets.token_hex(10)}"


def _with_key(args: dict, key: str | None, make: bool) -> bool:
    """Put idempotency key `key` in a request's `args`, or, given none and
    `make` (the daemon takes one), a key the SDK makes: whether it made it."""
    made = make and key is None
    if made:
        key = _made_key()
    if key is not None:
        args["key"] = key
    return made


def _sent_or_not(op: str, sent: bool, key: str | None = None) -> str:
    """What a lost connection leaves open of `op` (sent with idempotency key
    `key`, if any), for its error: whether it may have run (`sent`), or that
    it did not."""
    return lost_after_sending(op, key) if sent else "; the request was not sent, so it did not run"


def _follows(op: str, args: dict) -> bool:
    """A request that lasts until what it follows ends (SHORT_SLOTS)."""
    return op == "file_watch" or (op in ("events", "proc_logs") and args.get("follow", True) is not False)


def _answer_error(error: dict, op: str, args: dict) -> DsecError:
    """The error a daemon answered `op` with. Where it refused a request or
    a field this client knows, it runs an older dsecd than this client: one
    installed over and not restarted yet (an upgrade's `git pull` and setup
    change the client at once, the daemon at its restart), or another
    host's. The error then says so, and what to do; the daemon's own
    message says only that it does not know the name."""
    err = DsecError.from_wire(error)
    request = protocol.REQUESTS.get(op)
    if err.code != "bad_request" or request is None:
        return err
    ops, allowed = err.detail.get("ops"), err.detail.get("allowed")
    if isinstance(ops, list) and op not in ops:
        what = f"the request {op!r}"
    elif isinstance(allowed, list):
        ours = {f.name for f in dataclasses.fields(request)}
        newer = sorted(name for name in args if name in ours and name not in allowed)
        if not newer:
            return err
        what = f"the field(s) {', '.join(newer)} of {op!r}"
    else:
        return err
    err.message = (f"{err.message}: the daemon runs an older dsecd than this client, which sends {what}; "
                   "restart the daemon on the version installed (`systemctl restart dsecd`, which keeps "
                   "the sandboxes), or use a client of the daemon's version")
    err.detail = {**err.detail, "older_daemon": True}
    return err


def _refused_in_flight(error: dict) -> bool:
    """Whether an error answer is the daemon's refusal of a request over its
    in-flight limit, which it gives before the request runs."""
    return error.get("code") == "limit" and "in_flight" in (error.get("detail") or {})
