"""The daemon's engine: one service per concern, each given what it needs.

workers.py    Workers: the thread pool blocking work runs in, off the event loop
sandboxes.py  Sandbox and SandboxRegistry: every sandbox by id, its journal record
files.py      FileService: read, write, list and stat inside a sandbox
starts.py     ProcessStarter: a process started by a sandbox's init or the exec helper
execs.py      ExecService: execs, their streams and stdin, by init or the helper
images.py     ImageService: image requests, snapshots, layer mounts and the pager
network.py    NetworkService: a sandbox's network at create and destroy, net_show/net_set
events.py     EventBus: state changes published, streamed (`events`) and kept for replay
memory.py     MemoryService: pause, resume, job pause/resume, swap, DAMON, OOM kills
lifetimes.py  LifetimeService: TTL, idle TTL and leases (`renew`), the reaper
calls.py      CallService: stateless function calls in call sandboxes and zygotes

dsecd/node.py composes them (and the handlers not yet moved here) and
dsecd/server.py routes each request type to the service that owns it.
"""
