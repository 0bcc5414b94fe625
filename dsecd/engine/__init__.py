"""The daemon's engine: one service per concern, each given what it needs.

workers.py    Workers: the thread pool blocking work runs in, off the event loop
sandboxes.py  Sandbox and SandboxRegistry: every sandbox by id and key, its journal record
idranges.py   IdRanges: the user-namespace id range of each sandbox
events.py     EventBus: state changes published, streamed (`events`) and kept for replay
lifelog.py    the EventBus listener: one log line and the metrics counters per event
creates.py    CreateService: `create` (keys, warm pools, the queue, the create itself), pools
lifecycle.py  LifecycleService: destroy, list, inspect, top; init exits; re-adoption at start
lifetimes.py  LifetimeService: TTL, idle TTL and leases (`renew`), the reaper
memory.py     MemoryService: pause, resume, job pause/resume, swap, DAMON, OOM kills
images.py     ImageService: image requests, snapshots, layer mounts and the pager
builds.py     BuildService: Dockerfile builds, each step in a sandbox, the step cache
network.py    NetworkService: a sandbox's network at create and destroy, net_show/net_set
starts.py     ProcessStarter: a process started by a sandbox's init or the exec helper
execs.py      ExecService: execs, their streams and stdin, by init or the helper
procs.py      ProcessService: background processes, their output rings, restarts survived
vmprocs.py    VmProcs: a microVM's background processes, kept by its guest agent, re-attached
vmfiles.py    VmFiles: a microVM's files, directory copies, file watches and writable layer, via its agent
microvms.py   MicroVMService: a microVM's start, agent, execs, pause and resume through QEMU
vmtemplates.py TemplateService: when a microVM create boots and when it restores a template snapshot
vmballoon.py  BalloonService: the idle balloon of running microVMs
vmwatchdog.py VmWatchdog: a hung guest's agent stops answering pings, and its VM is ended
policies.py   PolicyService: which task policy (Landlock) each exec runs under, `policy_list`
denials.py    DenialService: task-policy denials counted per sandbox, policy and exec; `denied` events
files.py      FileService: read, write, list and stat inside a sandbox
copier.py     the bytes a file write puts in a sandbox, written by the sandbox (charged to its cgroup)
dircopies.py  DirCopyService: directory copies in and out of a sandbox as tar streams
watches.py    WatchService: `file_watch`, a directory's changes streamed over inotify
opkeys.py     OpKeys: idempotency keys of exec, proc_start and snapshot; a request sent again
keyedstream.py KeyedStream: a keyed streamed exec's output, kept for the request sent again
calls.py      CallService: stateless function calls in call sandboxes and zygotes

dsecd/node.py composes them and answers ping and info; dsecd/server.py
routes each request type to the service that owns it (node.SERVICE_ROUTES).
"""
