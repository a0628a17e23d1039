"""The audit's hostile spec inputs, one by one: each ends in one SpecError line that says where
and what to write instead, quickly, with bounded memory; secrets stay out of printed specs."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from ddplaunch.errors import SpecError
from ddplaunch.spec.load import backend_limits, load_spec
from ddplaunch.spec.model import ClusterSpec, EnvVar
from ddplaunch.spec.values import is_secret_name
from ddplaunch.spec.yamlsafe import MAX_BYTES, MAX_DEPTH, MAX_NODES, show
from tests.timing import SPEC_LOAD_UNITS, cpu_time, cpu_within

ROOT = Path(__file__).resolve().parents[2]

# A 333-byte billion-laughs file like the audit's: 9**7 "lol"s once expanded (`validate` printed 52 MB).
BOMB_333 = (b"# billion laughs: 9**7 lols, 333B\n"
            b"name: bomb\n"
            b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
            b"b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
            b"c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
            b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
            b"e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
            b"f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
            b"g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
            b"job: {args: *g}\n")


def spec_file(tmp_path: Path, text: "str | bytes", name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else textwrap.dedent(text).encode())
    (tmp_path / "jobs").mkdir(exist_ok=True)
    (tmp_path / "jobs" / "toy_ddp.py").write_text("print('hi')\n")
    return path


def refused(path: "Path | str") -> str:
    """The SpecError message of load_spec(path), checked to be one line under 4 kB within
    SPEC_LOAD_UNITS of CPU (about a second on a 2-core machine like CI's)."""
    with cpu_time() as cpu, pytest.raises(SpecError) as err:
        load_spec(path)
    cpu_within(cpu.seconds, SPEC_LOAD_UNITS, f"refusing {path.name if isinstance(path, Path) else path}")
    msg = str(err.value)
    assert "\n" not in msg and len(msg.encode()) < 4096
    return msg


# --------------------------------------------------------------------------- YAML mechanics


def test_the_333_byte_alias_bomb_is_refused_at_the_alias(tmp_path):
    assert len(BOMB_333) == 333
    path = spec_file(tmp_path, BOMB_333)
    assert refused(path) == (f"{path}:7:8: aliases expand to more than {MAX_NODES} values in all "
                             "(an alias bomb?); write the values out")


def test_merge_key_bomb_and_recursive_alias(tmp_path):
    prev = ["a"] + [f"m{i}" for i in range(8)]
    merge = "a: &a {x: 1, y: 2}\n" + "".join(
        f"m{i}: &m{i} {{<<: [{', '.join(['*' + prev[i]] * 8)}], k{i}: 1}}\n" for i in range(8))
    assert "aliases expand to more than" in refused(spec_file(tmp_path, merge))
    path = spec_file(tmp_path, "job: {args: &a [x, *a]}\n")
    assert refused(path) == (f"{path}:1:20: alias *a is inside its own anchor (a recursive structure); "
                             "write the value out")


def test_ordinary_anchors_and_merges_still_work(tmp_path):
    spec = load_spec(spec_file(tmp_path, """
        backend: ssh
        hosts:
          - &h {addr: 10.0.0.1, user: bob}
          - {<<: *h, addr: 10.0.0.2}
        job: {args: &a [--lr, "0.1"]}
        setup: *a
    """))
    assert [(h.addr, h.user) for h in spec.hosts] == [("10.0.0.1", "bob"), ("10.0.0.2", "bob")]
    assert spec.setup == ["--lr", "0.1"]


@pytest.mark.parametrize("text, expected", [
    ("job: {args: " + "[" * 500 + "]" * 500 + "}\n", f"values nested deeper than {MAX_DEPTH} levels"),
    ("job: {args: " + "[" * 5000 + "]" * 5000 + "}\n", "YAML syntax error: exceeded maximum nesting depth"),
    ("env:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(40)), "values nested deeper than"),
    ("a: &a " + "[" * 20 + "]" * 20 + "\nb: &b [[[[[[[[[[[[[[*a]]]]]]]]]]]]]]\n", "nests values deeper than"),
])
def test_deep_nesting_is_a_line_not_a_recursion_error(tmp_path, text, expected):
    assert expected in refused(spec_file(tmp_path, text))


def test_too_many_values_and_too_many_bytes(tmp_path):
    path = spec_file(tmp_path, "setup:\n" + "".join(f"  - echo {i}\n" for i in range(MAX_NODES + 10)))
    assert f"more than {MAX_NODES} values; a spec needs far fewer" in refused(path)
    big = spec_file(tmp_path, b"# " + b"x" * MAX_BYTES + b"\n")
    assert refused(big) == f"{big}: {MAX_BYTES + 3} bytes; a spec may have at most {MAX_BYTES} bytes"


@pytest.mark.parametrize("text", [
    "env:\n" + "".join(f"  K{i}: {i}\n" for i in range((MAX_NODES - 3) // 2)),
    "env:\n" + "".join(f"  K{i}: 0{i + 10}\n" for i in range((MAX_NODES - 3) // 2)),  # every one coerced
    "backend: ssh\nhosts:\n" + "".join(f"  - {{addr: 10.0.{i // 250}.{i % 250}, name: h{i}, user: u}}\n"
                                       for i in range((MAX_NODES - 4) // 7)),
    "# " + "x" * (MAX_BYTES - 10) + "\n",
    "name: " + "a" * (MAX_BYTES - 10) + "\n",
], ids=["5k-env", "5k-coerced", "1.4k-hosts", "1MiB-comment", "1MiB-scalar"])
def test_inputs_at_the_limits_load_within_a_bounded_cpu_time(tmp_path, text):
    path = spec_file(tmp_path, text)
    with cpu_time() as cpu:
        try:
            load_spec(path)
        except SpecError as err:
            assert "\n" not in str(err) and len(str(err)) < 4096
    cpu_within(cpu.seconds, SPEC_LOAD_UNITS, "loading a spec at the limits")


def test_4301_digit_integer(tmp_path):
    path = spec_file(tmp_path, "rdzv_timeout: " + "9" * 4301 + "\n")
    assert refused(path) == (f"{path}:1:15: rdzv_timeout: integer too large (4301 characters; at most 64 bits); "
                             "quote it if it is text")
    path = spec_file(tmp_path, "rdzv_timeout: 99999999999999999999\n")
    assert "integer too large (at most 64 bits)" in refused(path)


def test_nul_in_the_file_and_escaped_nul_in_a_value(tmp_path):
    path = spec_file(tmp_path, b"name: x\nhosts: [a\x00b]\n")
    assert refused(path) == f"{path}:2:10: U+0000 (NUL) in the file; remove it"
    path = spec_file(tmp_path, b'name: x\njob:\n  args: ["a\\0b"]\n')
    assert refused(path) == f"{path}:3:10: NUL character in a value; remove it"


@pytest.mark.parametrize("char, name", [("\x1b", "U+001B (ESC)"), ("\x7f", "U+007F (DEL)"),
                                        ("\x85", "U+0085 (NEL)"), ("\u2028", "U+2028 (control character)")])
def test_control_characters_in_the_file(tmp_path, char, name):
    path = spec_file(tmp_path, f"name: x\nworkdir: /a{char}b\n".encode())
    assert refused(path) == f"{path}:2:12: {name} in the file; remove it"


def test_latin1_file_names_the_byte_and_line(tmp_path):
    path = spec_file(tmp_path, "name: x\nworkdir: /home/ren\u00e9\n".encode("latin-1"))
    assert refused(path) == (f"{path}:2:19: not UTF-8 text (byte 0xe9 at offset 26); save the file as UTF-8")


def test_utf8_bom_and_crlf_are_fine(tmp_path):
    spec = load_spec(spec_file(tmp_path, "\ufeffname: x\r\nnproc_per_node: 2\r\n".encode()))
    assert spec.name == "x" and spec.nproc_per_node == 2


def test_explicit_tags_other_than_the_core_ones_are_refused(tmp_path):
    path = spec_file(tmp_path, "name: !!python/object/apply:os.system [echo pwned]\n")
    assert refused(path) == f"{path}:1:7: tag !!python/object/apply:os.system is not allowed in a spec; remove it"
    assert load_spec(spec_file(tmp_path, "name: !!str 010\n")).name == "010"


def test_anchor_defined_twice(tmp_path):
    path = spec_file(tmp_path, "setup: &x [a]\njob: {args: &x [b]}\n")
    assert refused(path) == f"{path}:2:13: anchor &x is defined twice (first at line 1); rename one"


def test_dates_stay_text_and_several_documents_are_refused(tmp_path):
    assert load_spec(spec_file(tmp_path, "name: 2024-01-01\n")).name == "2024-01-01"
    path = spec_file(tmp_path, "name: a\n---\nname: b\n")
    assert refused(path) == f"{path}:2:1: YAML syntax error: but found another document"


# --------------------------------------------------------------------------- duplicate keys


@pytest.mark.parametrize("text, line, key_path, key, first", [
    ("name: a\nbackend: local\n\n\n\n\nhosts: [x]\nname: b\n", 8, "name", "'name'", 1),
    ("hosts: [x]\nname: a\n\n\n\n\nhosts: [y]\n", 7, "hosts", "'hosts'", 1),
    ("healthcheck:\n  timeout: 5\n  iterations: 2\n  timeout: 6\n", 4, "healthcheck.timeout", "'timeout'", 2),
    ("env:\n  A: x\n  A: y\n", 3, "env.A", "'A'", 2),
    ("preflight: {enabled: yes, enabled: true}\n", 1, "preflight.enabled", "'enabled'", 1),
])
def test_duplicate_keys_name_both_lines(tmp_path, text, line, key_path, key, first):
    path = spec_file(tmp_path, text)
    assert refused(path) == f"{path}:{line}: {key_path}: duplicate key {key} (first at line {first})"


# --------------------------------------------------------------------------- paths


def test_bad_paths(tmp_path):
    assert refused("~nosuchuser/c.yaml") == "~nosuchuser/c.yaml: no such file; pass the path of a cluster spec such as cluster.yaml"
    long = tmp_path / ("a" * 300 + ".yaml")
    assert refused(long) == f"{show(long)}: cannot read: File name too long"
    assert refused(str(tmp_path / "c.yaml\0x")) == f"{tmp_path}/c.yaml\\x00x: the path contains a NUL character; pass a real file name"
    assert refused(tmp_path) == f"{tmp_path}: is a directory; pass the spec file inside it"
    assert refused("/dev/zero") == "/dev/zero: not a regular file; pass the path of a cluster spec file"
    assert refused("\ud800.yaml") == "\\ud800.yaml: not a usable file name"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    assert refused(fifo) == f"{fifo}: not a regular file; pass the path of a cluster spec file"


def test_bad_paths_inside_the_spec(tmp_path):
    path = spec_file(tmp_path, "name: x\nworkdir: ~nosuchuser/work\n")
    assert refused(path) == (f"{path}:2: workdir: '~nosuchuser/work': cannot expand ~ (no such user or no "
                             "home directory); write the full path")
    path = spec_file(tmp_path, f"job:\n  script: {'s' * 300}.py\n")
    assert refused(path) == f"{path}:2: job.script: cannot use this path: File name too long"
    path = spec_file(tmp_path, "backend: ssh\nhosts: [a]\nssh:\n  key: ~nosuchuser/.ssh/id\n")
    assert "ssh.key: '~nosuchuser/.ssh/id': cannot expand ~" in refused(path)


# --------------------------------------------------------------------------- env coercion


@pytest.mark.parametrize("value, becomes", [
    ("010", "8"), ("on", "true"), ("yes", "true"), ("off", "false"), ("12:30", "750"),
    ("0x1F", "31"), ("1.0e+3", "1000.0"), ("1.50", "1.5"), (".inf", "inf"), ("1_000", "1000"),
])
def test_env_values_yaml_would_coerce_are_refused_with_the_quoted_form(tmp_path, value, becomes):
    path = spec_file(tmp_path, f"name: x\nenv:\n  X: {value}\n")
    assert refused(path) == f'{path}:3: env.X: {value} would become {becomes}; write X: "{value}"'


def test_empty_and_null_env_values(tmp_path):
    path = spec_file(tmp_path, "env:\n  X:\n")
    assert refused(path) == f'{path}:2: env.X: an empty value would become null; write X: ""'
    path = spec_file(tmp_path, "env:\n  X: ~\n")
    assert refused(path) == f'{path}:2: env.X: ~ means no value; write X: "~"'


def test_env_values_that_read_back_as_written_are_accepted(tmp_path):
    spec = load_spec(spec_file(tmp_path, 'env: {A: 1, B: 1.5, C: -3, D: "010", E: text, F: "on"}\n'))
    assert spec.env_values({}) == {"A": "1", "B": "1.5", "C": "-3", "D": "010", "E": "text", "F": "on"}


def test_several_coercions_one_line_with_a_count(tmp_path):
    path = spec_file(tmp_path, "env:\n  A: 010\n  B: on\n  C:\n")
    assert refused(path) == f'{path}:2: env.A: 010 would become 8; write A: "010" (and 2 more problems)'


# --------------------------------------------------------------------------- shell-bound values


@pytest.mark.parametrize("text, line, key_path, problem", [
    ('backend: slurm\nslurm:\n  partition: "gpu\\n#SBATCH --uid=0"\n', 3, "slurm.partition",
     "U+000A (LF) at character 4; a command or #SBATCH line cannot hold it"),
    ('backend: slurm\nslurm:\n  sbatch_extra: ["--mem=0", "--x\\nrm -rf /"]\n', 3, "slurm.sbatch_extra.1",
     "U+000A (LF) at character 4; a command or #SBATCH line cannot hold it"),
    ("backend: slurm\nslurm:\n  sbatch_extra: [exclusive]\n", 3, "slurm.sbatch_extra.0",
     "'exclusive' must be an sbatch option starting with -- (e.g. --exclusive)"),
    ('workdir: "/tmp\\n; rm -rf ~"\n', 1, "workdir", "U+000A (LF) at character 5; a command or #SBATCH line cannot hold it"),
    ('python: "/usr/bin/python\\r"\n', 1, "python", "U+000D (CR) at character 16; a command or #SBATCH line cannot hold it"),
    ('job: {script: "a\\tb.py"}\n', 1, "job.script", "U+0009 (TAB) at character 2; a command or #SBATCH line cannot hold it"),
    ('backend: ssh\nhosts: ["-oProxyCommand=touch /tmp/x"]\n', 2, "hosts.0.addr",
     "'-oProxyCommand=touch /tmp/x' is not a host address (a name or IP: letters, digits, . _ - : % [ ])"),
    ("backend: ssh\nhosts:\n  - {addr: a, name: 'gpu 1'}\n", 3, "hosts.0.name",
     "'gpu 1' is not a host name (letters, digits, . _ -)"),
    ("backend: ssh\nhosts:\n  - {addr: a, name: ..}\n", 3, "hosts.0.name", "'..' is not a host name (letters, digits, . _ -)"),
    ("backend: ssh\nhosts:\n  - {addr: a, user: 'root; id'}\n", 3, "hosts.0.user",
     "'root; id' is not a user name (letters, digits, _ . -, starting with a letter or _)"),
    ("backend: ssh\nssh: {user: -l}\n", 2, "ssh.user", "'-l' is not a user name (letters, digits, _ . -, starting with a letter or _)"),
    ('backend: ssh\nssh: {known_hosts: "k\\u2028h"}\n', 2, "ssh.known_hosts",
     "U+2028 (control character) at character 2; a command or #SBATCH line cannot hold it"),
    ("backend: slurm\nslurm: {account: 'a b'}\n", 2, "slurm.account", "'a b' is not a Slurm name (letters, digits, _ . + -)"),
    ("backend: slurm\nslurm: {time: 1h}\n", 2, "slurm.time", "'1h' is not a Slurm time limit (MINUTES, MM:SS, "
     "HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED)"),
    ("env: {MY-VAR: x}\n", 1, "env.MY-VAR", "'MY-VAR' is not a valid environment variable name (letters, digits and "
     "_, not starting with a digit)"),
    ("env: {X: {from_env: a.b}}\n", 1, "env.X.from_env", "'a.b' is not a valid environment variable name (letters, "
     "digits and _, not starting with a digit)"),
    ('job: {args: ["a\\0b"]}\n', 1, None, None),  # NUL: refused by the loader already (tested above)
])
def test_values_that_reach_a_shell_or_sbatch_line(tmp_path, text, line, key_path, problem):
    path = spec_file(tmp_path, text)
    msg = refused(path)
    if key_path is not None:
        assert msg == f"{path}:{line}: {key_path}: {problem}"


def test_representable_values_are_accepted(tmp_path):
    spec = load_spec(spec_file(tmp_path, """
        backend: slurm
        python: /opt/env=prod/bin/python
        job: {args: ["--msg", "two\\nlines", "--lr", 0.5]}
        slurm:
          partition: gpu,debug
          account: proj-1.x
          qos: high+
          time: 60
          sbatch_extra: ["--exclusive", "--mem=0"]
    """))
    assert spec.python == "/opt/env=prod/bin/python" and spec.slurm.time == "60"
    assert spec.job.args == ["--msg", "two\nlines", "--lr", "0.5"]
    for time_limit in ("30", "30:00", "1:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED"):
        assert load_spec(spec_file(tmp_path, f"backend: slurm\nslurm: {{time: '{time_limit}'}}\n")).slurm.time == time_limit
    path = spec_file(tmp_path, "backend: slurm\nslurm: {time: 1:00:00}\n")
    assert refused(path) == f'{path}:2: slurm.time: 1:00:00 would become 3600; write time: "1:00:00"'


def test_huge_values_are_shortened_in_messages(tmp_path):
    path = spec_file(tmp_path, "name: " + "x" * 100_000 + "\n")
    msg = refused(path)
    assert msg.startswith(f"{path}:1: name: String should match pattern") and "xxx...xxx" in msg and len(msg) < 1000
    deep = tmp_path / ("d" * 200) / ("e" * 200) / ("f" * 200)
    deep.mkdir(parents=True)
    assert len(refused(deep / "missing.yaml")) < 500


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("name", ["HF_TOKEN", "GITHUB_TOKEN", "hf_token", "AWS_SECRET_ACCESS_KEY", "CLIENT_SECRET",
                                  "DB_PASSWORD", "PGPASSWORD", "DB_PASS", "PASS", "AWS_CREDENTIALS", "WANDB_API_KEY",
                                  "APIKEY", "OPENAI_KEY", "KEY", "SSH_PRIVATE_KEY_PATH", "AUTH", "GH_AUTH_HEADER",
                                  "AUTHORIZATION", "MY_AUTHTOKEN", "SESSION_COOKIE", "HF_TOKENS", "AUTHKEY",
                                  "OAUTH_CLIENT_SECRET", "Db_Pass", "SSHPASS", "PGPASS", "MYSQL_PWD", "GH_PAT",
                                  "GITLAB_PAT", "SMB_PASS"])
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("value, secret", [("postgres://app:s3cr3t@db:5432/x", True), ("https://u:p@proxy:3128", True),
                                           ("redis://:hunter2@cache", True), ("postgres://app@db/x", False),
                                           ("https://example.com/a:b@c", False), ("plain", False)])
def test_urls_with_a_password_are_secret_whatever_their_name(tmp_path, value, secret):
    spec = ClusterSpec.model_validate({"env": {"DATABASE_URL": value}})
    assert ("DATABASE_URL" in spec.secret_names()) is secret
    if secret:
        assert spec.redacted()["env"]["DATABASE_URL"] == "<secret>"


@pytest.mark.parametrize("name", ["KEYBOARD_LAYOUT", "MONKEY", "PASSENGER", "TOKENIZERS_PARALLELISM", "PWD", "PATH",
                                  "GIT_AUTHOR_NAME", "NCCL_SOCKET_IFNAME", "AWS_ACCESS_KEY_ID", "KEY_FILE_DIR",
                                  "BYPASS_PROXY", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "COMPASS", "GIT_AUTHORS",
                                  "KEYS_DIR", "TOKENIZER_NAME", "NCCL_IB_HCA", "PAT", "TRESPASS_LOG", "OLDPWD"])
def test_ordinary_names_are_not_secret(name):
    assert not is_secret_name(name)


SECRETS_SPEC = """
    env:
      PYTHONUNBUFFERED: "1"
      HF_TOKEN: {from_env: HF_TOKEN}
      DB_URL: {value: "postgres://u:hunter2@db/x", secret: true}
      WANDB_API_KEY: "wk-123"
      PLAIN_VALUE: {value: "plain", secret: false}
"""


def test_redacted_shows_no_secret_value(tmp_path):
    spec = load_spec(spec_file(tmp_path, SECRETS_SPEC))
    data = spec.redacted()
    assert data["env"] == {"PYTHONUNBUFFERED": "1", "HF_TOKEN": {"from_env": "HF_TOKEN"}, "DB_URL": "<secret>",
                           "WANDB_API_KEY": "<secret>", "PLAIN_VALUE": "plain"}
    assert "hunter2" not in repr(data) and "wk-123" not in repr(data)
    assert "base_dir" not in data and data["backend"] == "local"
    assert spec.secret_names() == {"HF_TOKEN", "DB_URL", "WANDB_API_KEY"}


def test_env_values_resolves_from_env_and_names_what_is_missing(tmp_path):
    spec = load_spec(spec_file(tmp_path, SECRETS_SPEC))
    assert spec.env_values({"HF_TOKEN": "hf_abc"})["HF_TOKEN"] == "hf_abc"
    assert spec.env_values({"HF_TOKEN": "hf_abc"})["DB_URL"] == "postgres://u:hunter2@db/x"
    with pytest.raises(SpecError) as err:
        spec.env_values({})
    assert str(err.value) == ("env.HF_TOKEN: from_env HF_TOKEN is not set in the launcher's environment; "
                              "export it before ddplaunch up")


@pytest.mark.parametrize("text, problem", [
    ("env: {X: {value: a, from_env: B}}\n", 'env.X: needs exactly one of value: "..." or from_env: NAME'),
    ("env: {X: {secret: true}}\n", 'env.X: needs exactly one of value: "..." or from_env: NAME'),
    ("env: {X: [a]}\n", 'env.X: must be a string, {from_env: NAME} or {value: "...", secret: true}'),
    ("env: {X: {valu: a}}\n", "env.X.valu: unknown key 'valu' (did you mean 'value'?)"),
])
def test_env_entry_shapes(tmp_path, text, problem):
    path = spec_file(tmp_path, text)
    assert refused(path).startswith(f"{path}:1: {problem}")


def test_env_var_model_directly():
    assert EnvVar.model_validate("x") == EnvVar(value="x")
    assert ClusterSpec.model_validate({"env": {"A": 1}}).env_values({}) == {"A": "1"}


# --------------------------------------------------------------------------- backend limits


@pytest.mark.parametrize("text, line, key_path, backend, reason", [
    ("backend: slurm\nhosts: [a]\n\nsync: [data]\n", 4, "sync", "slurm",
     "Slurm jobs read the shared file system: put the files there"),
    ("backend: slurm\nhosts:\n  - {addr: a, user: bob}\n", 3, "hosts.0.user", "slurm",
     "Slurm starts every step as the submitting user"),
    ("backend: slurm\nhosts:\n  - a\n  - {addr: b, port: 2222}\n", 4, "hosts.1.port", "slurm",
     "Slurm reaches its nodes itself; no SSH port is used"),
    ("backend: slurm\nhosts:\n  - {addr: a, python: /opt/py}\n", 3, "hosts.0.python", "slurm",
     "use `python:` for every node"),
    ("backend: slurm\nmaster:\n  addr: node1\n", 3, "master.addr", "slurm", "Slurm's first allocated node is the master"),
    ("backend: slurm\nssh:\n  user: bob\n", 3, "ssh.user", "slurm", "only used by backend: ssh"),
    ("backend: local\nsync: [x]\n", 2, "sync", "local", "the local backend runs in place: the files are already here"),
    ("backend: local\nslurm:\n  time: '60'\n", 3, "slurm.time", "local", "only used by backend: slurm"),
    ("backend: ssh\nhosts: [a]\nslurm:\n  requeue: true\n", 4, "slurm.requeue", "ssh", "only used by backend: slurm"),
])
def test_backend_limits(tmp_path, text, line, key_path, backend, reason):
    path = spec_file(tmp_path, text)
    assert refused(path) == f"{path}:{line}: {key_path}: not supported by backend '{backend}' ({reason})"


def test_backend_limits_ignore_defaults_and_the_table_is_data(tmp_path):
    load_spec(ROOT / "cluster.yaml")  # sets every ssh:/slurm: key, all to their defaults
    spec = load_spec(spec_file(tmp_path, "backend: slurm\nhosts: [a]\nsync: []\nmaster: {addr: null}\n"
                                         "ssh: {port: null}\nhosts: [b]\n".replace("hosts: [b]\n", "")))
    assert spec.backend == "slurm"
    limits = {name: backend_limits(name) for name in ("local", "ssh", "slurm")}
    assert limits["ssh"] == {"slurm": "only used by backend: slurm"}  # a section another backend owns
    assert limits["local"]["ssh"] == "only used by backend: ssh" and "sync" in limits["slurm"]
    assert all(isinstance(r, str) and r for table in limits.values() for r in table.values())


# --------------------------------------------------------------------------- without libyaml


@pytest.mark.parametrize("text, expected", [
    (BOMB_333, ":7:8: aliases expand to more than"),
    (b"job: {args: " + b"[" * 5000 + b"]" * 5000 + b"}\n", f":1:43: values nested deeper than {MAX_DEPTH} levels"),
    (b"rdzv_timeout: " + b"9" * 4301 + b"\n", ":1:15: rdzv_timeout: integer too large"),
    (b'job: {args: ["a\\0b"]}\n', ":1:14: NUL character in a value"),
    (b"name: a\nname: b\n", ":2: name: duplicate key 'name' (first at line 1)"),
    (b"env:\n  X: 010\n", ':2: env.X: 010 would become 8; write X: "010"'),
])
def test_the_pure_python_loader_keeps_the_same_limits(tmp_path, monkeypatch, text, expected):
    """PyYAML without libyaml (a source install) gets the same checks, under a smaller size limit."""
    from ddplaunch.spec import yamlsafe

    monkeypatch.setattr(yamlsafe, "_Loader", yamlsafe._loader_class(libyaml=False))
    path = spec_file(tmp_path, text)
    assert refused(path).startswith(f"{path}{expected}")


def test_validate_prints_no_secret(tmp_path):
    """`ddplaunch validate` prints the redacted spec: names and from_env sources, never values."""
    import subprocess
    import sys

    path = spec_file(tmp_path, SECRETS_SPEC)
    proc = subprocess.run([sys.executable, "-m", "ddplaunch", "validate", str(path)], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hunter2" not in proc.stdout and "wk-123" not in proc.stdout
    assert "DB_URL: <secret>" in proc.stdout and "from_env: HF_TOKEN" in proc.stdout


@pytest.mark.parametrize("name", ["DDPLAUNCH_RUN_ID", "ddplaunch_run_id", "DDPLAUNCH_RECOVERY", "DDPLAUNCH_HOST"])
def test_variables_ddplaunch_sets_cannot_be_set_by_the_spec(tmp_path, name):
    msg = refused(spec_file(tmp_path, f"env: {{{name}: x}}\n"))
    assert f"env.{name}" in msg and "set by ddplaunch for every rank" in msg, msg


def test_other_ddplaunch_variables_are_the_users(tmp_path):
    spec = load_spec(spec_file(tmp_path, "env: {DDPLAUNCH_CKPT_DIR: /ckpt, DDPLAUNCH_HC_FAULT_RANK: '1'}\n"))
    assert set(spec.env) >= {"DDPLAUNCH_CKPT_DIR", "DDPLAUNCH_HC_FAULT_RANK"}
