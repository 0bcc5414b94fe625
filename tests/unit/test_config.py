import re

import pytest

from dsecd.config import ConfigError, load_config, parse_size, with_setting


@pytest.mark.parametrize("text, value", [(0, 0), ("123", 123), ("4K", 4096), ("512M", 512 << 20),
                                         ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("16m", 16 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "12Q", "-1", "M", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


def test_defaults_load_and_every_size_parses():
    cfg = load_config()
    assert cfg.socket == "/run/dsecd/dsecd.sock"
    assert cfg.size("limits", "max_frame_bytes") == 16 << 20


def test_user_file_overrides_only_named_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[limits]\nmax_sandboxes = 7\n[daemon]\nsocket = "/tmp/x.sock"\n')
    cfg = load_config(str(f))
    assert cfg.section("limits")["max_sandboxes"] == 7
    assert cfg.socket == "/tmp/x.sock"
    assert cfg.section("limits")["max_connections"] == 4096


def test_unknown_key_is_an_error_naming_it(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[limits]\nmax_sandbox = 7\n")
    with pytest.raises(ConfigError, match="limits.max_sandbox"):
        load_config(str(f))


@pytest.mark.parametrize("key, says", [("skopeo", "talks to registries itself"),
                                       ("pull_convert_threads", "images.pull_parallel_layers")])
def test_a_removed_key_is_an_error_saying_what_replaced_it(tmp_path, key, says):
    f = tmp_path / "c.toml"
    f.write_text(f'[images]\n{key} = 1\n')
    with pytest.raises(ConfigError, match=f"images.{key}' was removed: .*{says}"):
        load_config(str(f))


def test_removed_keys_are_not_config_keys():
    cfg = load_config()
    from dsecd.config import REMOVED
    for name in REMOVED:
        table, key = name.rsplit(".", 1)
        assert key not in cfg.section(table), f"{name} is both removed and in default.toml"


def test_bad_toml_and_missing_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[limits\n")
    with pytest.raises(ConfigError, match="parse config"):
        load_config(str(f))
    with pytest.raises(ConfigError, match="read config"):
        load_config(str(tmp_path / "absent.toml"))


def test_chunk_must_fit_in_frame():
    with pytest.raises(ConfigError, match="max_file_chunk_bytes"):
        load_config(overrides={"limits": {"max_frame_bytes": "1M", "max_file_chunk_bytes": "1M"}})


def test_the_log_format_and_level_are_checked_at_load():
    with pytest.raises(ConfigError, match="daemon.log_format"):
        load_config(overrides={"daemon": {"log_format": "xml"}})
    with pytest.raises(ConfigError, match="daemon.log_level"):
        load_config(overrides={"daemon": {"log_level": "verbose"}})
    assert load_config().section("daemon")["log_format"] == "json"
    assert load_config().section("metrics") == {"listen": "", "per_sandbox": False}


def test_the_config_file_is_etc_dsecd_when_it_exists_and_none_is_named(tmp_path, monkeypatch):
    from dsecd import daemon

    etc = tmp_path / "dsecd.toml"
    monkeypatch.setattr(daemon, "DEFAULT_PATH", str(etc))
    assert daemon.config_path(None) is None                 # absent: the embedded defaults
    etc.write_text("[limits]\nmax_sandboxes = 9\n")
    assert daemon.config_path(None) == str(etc)
    assert daemon.build_config(daemon.parse_args([])).section("limits")["max_sandboxes"] == 9
    given = tmp_path / "other.toml"
    given.write_text("[limits]\nmax_sandboxes = 3\n")
    assert daemon.build_config(daemon.parse_args(["--config", str(given)])).path == str(given)
    with pytest.raises(ConfigError, match="read config"):             # named but absent: an error
        daemon.build_config(daemon.parse_args(["--config", str(tmp_path / "absent.toml")]))


def test_with_setting_adds_a_key_once_and_keeps_one_the_text_sets():
    assert with_setting("", "net", "bpf_cache_dir", "/c") == '\n[net]\nbpf_cache_dir = "/c"\n'
    assert with_setting("[net]\nmtu = 1400\n", "net", "bpf_cache_dir", "/c") == \
        '[net]\nbpf_cache_dir = "/c"\nmtu = 1400\n'
    own = '[net]\nbpf_cache_dir = "/mine"\n'
    assert with_setting(own, "net", "bpf_cache_dir", "/c") == own
    assert with_setting("[a]\n", "microvm", "guest_dir", None) == "[a]\n"


@pytest.mark.parametrize("text, says", [
    ("[limits]\nmax_sandboxes = -1", "'limits.max_sandboxes' must be above zero, got -1"),
    ("[limits]\nmax_sandboxes = true", "'limits.max_sandboxes' must be a whole number, got True"),
    ('[sandbox]\npids = "many"', "'sandbox.pids' must be a whole number, got 'many'"),
    ("[sandbox]\npids = 1.5", "'sandbox.pids' must be a whole number"),
    ("[sandbox]\ncpu = -1.0", "'sandbox.cpu' must be above zero"),
    ("[sandbox.cpu]\nx = 1", "'sandbox.cpu' must be a number, got {'x': 1}"),
    ('[journal]\nfsync = "yes"', "'journal.fsync' must be true or false, got 'yes'"),
    ("[daemon]\nworker_threads = 0", "'daemon.worker_threads' must be above zero, got 0"),
    ('[limits]\nframe_timeout_s = "30s"', "'limits.frame_timeout_s' must be a number, got '30s'"),
    ("[sandbox]\nmemory = -5", "'sandbox.memory' must be zero or more"),
    ("[sandbox]\nmemory = true", "'sandbox.memory' must be a string or a number"),
    ("[images]\npull_retries = -1", "'images.pull_retries' must be zero or more"),
    ('[sandbox]\ncapabilities = "CHOWN"', "'sandbox.capabilities' must be a list of strings"),
    ('[sandbox]\ncapabilities = ["CHOWN", "FLY"]', "unknown capability 'FLY' in sandbox.capabilities"),
    ("[net]\ndns_upstreams = [1]", "'net.dns_upstreams' must be a list of strings, got [1]"),
    ('[sandbox]\nbackend = "docker"', "sandbox.backend must be one of container, microvm, got 'docker'"),
    ('[images]\nmode = "fast"', "images.mode must be one of auto, lazy, eager, direct, got 'fast'"),
    ('[fncall]\nmemory = "lots"', "'fncall.memory' must be a size (bytes, or a number with K, M, G or T), got 'lots'"),
    ('[fncall]\nrlimit_as = "1X"', "'fncall.rlimit_as' must be a size"),
    ('[fncall]\ntmp_size = "0"', "'fncall.tmp_size' must be above zero"),
    ('[fncall]\nqos = "x"', "fncall.qos must be one of ls, be, got 'x'"),
    # Names read only where they are used: a bad one stopped the start with a
    # traceback, or failed every create that took the default.
    ('[memory]\nprefetch = "always"', "memory.prefetch must be one of populate, willneed, both, none, got 'always'"),
    ('[memory.damon]\noperations = "x"', "memory.damon.operations must be one of paddr, vaddr, got 'x'"),
    ('[memory]\nv1_reclaim = ["drop"]', "memory.v1_reclaim must name only pageout, limit, force_empty, got 'drop'"),
    ('[net]\ndefault_mode = "bridge"', "net.default_mode must be one of none, default, got 'bridge'"),
    ('[net]\ndns_refuse = "drop"', "net.dns_refuse must be one of refused, nxdomain, got 'drop'"),
    # 0 s: the balloon policy stopped the start with a traceback.
    ("[microvm]\nballoon_idle_s = 0", "'microvm.balloon_idle_s' must be above zero, got 0"),
    ("[microvm]\nballoon_interval_s = 0", "'microvm.balloon_interval_s' must be above zero, got 0"),
    # A VM answers a ping per interval: a timeout not longer killed every VM as hung.
    ("[microvm]\nwatchdog_timeout_s = 0", "microvm.watchdog_timeout_s (0) must be longer than "
                                            "microvm.watchdog_interval_s (10.0)"),
    ("[microvm]\nwatchdog_timeout_s = 5\nwatchdog_interval_s = 5", "microvm.watchdog_timeout_s (5) must be"),
    ('[fncall]\npython = ""', "fncall.python must name the interpreter"),
    ("[fncall]\nuid_base = -1", "'fncall.uid_base' must be zero or more, got -1"),
    # Calls run under ids of their call sandbox's user namespace.
    ("[fncall]\nuid_base = 100000", "fncall.uid_base + fncall.uid_count (100000 + 4096) must be at most "
                                    "sandbox.userns_size (65536)"),
    # 0 s for the zygote to report a killed call's end: every timeout replaced the zygote.
    ("[fncall]\nkill_grace_s = 0", "'fncall.kill_grace_s' must be above zero, got 0"),
    # Every call's worker took the limit: each ended with SIGSEGV, 127 or a
    # MemoryError, with nothing saying why (0 is no "unlimited" here).
    ('[fncall]\nrlimit_as = "0"', "'fncall.rlimit_as' must be above zero, got '0'"),
    ("[fncall]\nrlimit_fsize = 0", "'fncall.rlimit_fsize' must be above zero, got 0"),
    ("[fncall]\nrlimit_nofile = 7", "fncall.rlimit_nofile must be at least 8, got 7"),
    # Read only when the network is built: stopped at start, naming the key.
    ('[net]\ndefault_mode = "bridge"', "net.default_mode must be one of none, default, got 'bridge'"),
    ('[net]\ndns_refuse = "drop"', "net.dns_refuse must be one of refused, nxdomain, got 'drop'"),
    ('[net]\npublish_ports = "abc"', "net.publish_ports must be a port range LO-HI (or one port) within "
                                      "1-65535, LO <= HI, got 'abc'"),
    ('[net]\npublish_ports = "40000-30000"', "net.publish_ports must be a port range"),
    ('[net]\npublish_ports = "0-100"', "net.publish_ports must be a port range"),
    ('[net]\npublish_ports = "30000-70000"', "net.publish_ports must be a port range"),
])
def test_a_value_of_the_wrong_kind_or_range_is_an_error_naming_the_key(tmp_path, text, says):
    f = tmp_path / "c.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(f))
    assert says in str(err.value)


def test_balloon_sizes_that_contradict_each_other_are_a_config_error():
    from dsecd.engine.vmballoon import settings_from

    cfg = load_config(overrides={"microvm": {"balloon_low_available": "64M", "balloon_headroom": "64M"}})
    with pytest.raises(ConfigError, match="microvm: balloon_low_available must be below balloon_headroom"):
        settings_from(cfg)


@pytest.mark.parametrize("root", ["", "/", ".", "..", "/dsecd", "../dsecd", "dsecd/../..", "dsecd//x", " "])
def test_the_cgroup_root_must_name_a_subtree_of_its_own(root):
    # At start the daemon destroys every group below cgroup_root that no
    # journal record names: "" or ".." would be the host's own groups
    # (system.slice, user.slice, ...), every process in them killed.
    with pytest.raises(ConfigError, match="sandbox.cgroup_root must be"):
        load_config(overrides={"sandbox": {"cgroup_root": root}})


@pytest.mark.parametrize("root", ["dsecd", "dsecd-test-1a2b", "dsecd/nested"])
def test_a_cgroup_root_of_names_loads(root):
    assert load_config(overrides={"sandbox": {"cgroup_root": root}}).section("sandbox")["cgroup_root"] == root


@pytest.mark.parametrize("text", [
    "[sandbox]\nmemory = 536870912",          # a size as bytes
    '[net]\npublish_ports = "8080"',            # one port
    "[sandbox]\ndefault_ttl = 30",            # a duration as seconds
    "[sandbox]\ncpu = 2",                     # a whole number where a number goes
    "[cpu]\noversubscription = 0",            # 0: the check is off
    "[limits]\nmax_exec_timeout_s = 0",       # 0: no limit
    "[microvm]\nwatchdog_interval_s = 0\nwatchdog_timeout_s = 0",    # 0: no liveness check
    "[images]\nsnapshot_exclude = ['/tmp']",
    '[fncall]\nmemory = "1.5G"',
])
def test_values_of_the_kinds_the_defaults_document_load(tmp_path, text):
    f = tmp_path / "c.toml"
    f.write_text(text + "\n")
    load_config(str(f))


@pytest.mark.parametrize("key", ["cache_max_bytes", "bandwidth_bps"])
@pytest.mark.parametrize("value, size", [('"10G"', 10 << 30), ('"512M"', 512 << 20), ("4096", 4096), ("0", 0)])
def test_the_pagers_byte_counts_take_a_size_as_other_sizes_do(tmp_path, key, value, size):
    f = tmp_path / "c.toml"
    f.write_text(f"[pager]\n{key} = {value}\n")
    assert load_config(str(f)).size("pager", key) == size


@pytest.mark.parametrize("section, key", [("daemon", "socket"), ("daemon", "state_dir"), ("images", "store"),
                                          ("images", "auth_file"), ("images", "certs_dir"),
                                          ("net", "bpf_cache_dir"), ("microvm", "guest_dir")])
def test_a_relative_path_is_an_error_naming_the_key(tmp_path, section, key):
    """Relative to the daemon's working directory, a path names one place
    when dsecd is started by hand and another under systemd (cwd /): the
    same config, two state dirs, and the second start destroys the first
    one's sandboxes under the same cgroup_root as leftovers."""
    f = tmp_path / "c.toml"
    f.write_text(f'[{section}]\n{key} = "var/lib/x"\n')
    with pytest.raises(ConfigError, match=rf"{section}\.{key} must be an absolute path, got 'var/lib/x'"):
        load_config(str(f))
    f.write_text(f'[{section}]\n{key} = "/var/lib/x"\n')
    assert load_config(str(f)).section(section)[key] == "/var/lib/x"


@pytest.mark.parametrize("section, key", [("images", "store"), ("images", "auth_file"), ("images", "certs_dir"),
                                          ("net", "bpf_cache_dir"), ("memory.swapfile", "path")])
def test_an_empty_path_keeps_meaning_its_default(section, key):
    table = {}
    overrides = table
    for part in section.split("."):
        table[part] = {}
        table = table[part]
    table[key] = ""
    load_config(overrides=overrides)


def test_the_daemons_path_options_are_taken_from_where_it_is_started(tmp_path, monkeypatch):
    from dsecd import daemon

    monkeypatch.chdir(tmp_path)
    cfg = daemon.build_config(daemon.parse_args(["--state-dir", "state", "--socket", "run/d.sock"]))
    assert cfg.state_dir == tmp_path / "state" and cfg.socket == str(tmp_path / "run" / "d.sock")


@pytest.mark.parametrize("key", ["bridge", "sandbox_ifname"])
@pytest.mark.parametrize("name", ["averyverylongname", "", "a/b", "a b", "a:b", ".", ".."])
def test_an_interface_name_the_kernel_refuses_is_a_config_error(key, name):
    """Made when the network is first built, maybe at the first --net
    default create: a name the kernel refuses must stop the start, not
    leave networking "unavailable: NetlinkError: (34, 'Numerical result out
    of range')" naming no key."""
    with pytest.raises(ConfigError, match=rf"net\.{key} must be a network interface name"):
        load_config(overrides={"net": {key: name}})


@pytest.mark.parametrize("name", ["dsec0", "dsect-1a2b3c4d", "fifteen-chars-x", "eth0"])
def test_an_interface_name_the_kernel_takes_loads(name):
    assert load_config(overrides={"net": {"bridge": name}}).section("net")["bridge"] == name


@pytest.mark.parametrize("net, says", [
    ({"mtu": 90000}, "net.mtu must be 68 to 65535, got 90000"),
    ({"mtu": 60}, "net.mtu must be 68 to 65535, got 60"),
    ({"mtu": 1000, "ipv6_subnet": "fd00:abcd:1::/64"}, "net.mtu must be at least 1280 with net.ipv6_subnet"),
])
def test_an_mtu_the_kernel_refuses_is_a_config_error(net, says):
    """Set on the bridge and veths when the network is first built: out of
    the kernel's range it left --net default "unavailable: NetlinkError:
    (22, 'Invalid argument')", naming no key."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        load_config(overrides={"net": net})


@pytest.mark.parametrize("net", [{"mtu": 68}, {"mtu": 65535}, {"mtu": 1280, "ipv6_subnet": "fd00:abcd:1::/64"}])
def test_an_mtu_the_kernel_takes_loads(net):
    load_config(overrides={"net": net})
