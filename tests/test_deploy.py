"""The deployment files under ``deploy/`` against the real CLI (fast; no kubectl, no network).

Every ``dips <command> ...`` written in a Kubernetes manifest (a container's ``command`` /
``args``, or a shell script inside them) or in the Slurm script (comment lines ignored) must
name a command of ``dips`` and use only its options, read from the typer app itself, and
give every required option. The manifests are checked for what the deployment relies on:
``apiVersion``/``kind``, one leader with ``strategy: Recreate``, followers in a StatefulSet
with a headless Service, the ``--listen``/``--data-listen`` ports declared as container
ports, Services that select pods and name their ports, and a run config that validates and
matches the number of followers. A failure names the file, the command and the flag.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

import dips.cli

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
SBATCH = ROOT / "deploy" / "slurm" / "cluster.sbatch"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
FLAG = re.compile(r"^--?[A-Za-z]")
OPERATOR = re.compile(r"^[();<>|&]+$")


# ---------------------------------------------------------------- the CLI, introspected

@dataclass
class Cmd:
    """One ``dips`` command: its options (every spelling) and the required ones."""

    options: set[str]
    required: set[str]  # the first spelling of each required option


def cli_commands() -> dict[str, Any]:
    """The click group behind ``dips`` (typer's own click types: matched by duck typing)."""
    return typer.main.get_command(dips.cli.app)


def describe(group: Any, path: list[str]) -> tuple[Cmd | None, list[str], str]:
    """(the command at the start of ``path``, the rest of ``path``, its name); descends into
    sub-groups (``dips bench ...``). The command is None when unknown."""
    node, name, rest = group, "dips", list(path)
    while hasattr(node, "commands"):
        if not rest or FLAG.match(rest[0]):
            return None, rest, name
        sub = node.commands.get(rest[0])
        if sub is None:
            return None, rest, f"{name} {rest[0]}"
        node, name, rest = sub, f"{name} {rest[0]}", rest[1:]
    ctx = group.context_class(group, info_name="dips")
    options: set[str] = set()
    required: set[str] = set()
    for param in node.get_params(ctx):  # includes --help
        if getattr(param, "param_type_name", None) != "option":
            continue
        options.update(param.opts)
        options.update(param.secondary_opts)
        if param.required:
            required.add(param.opts[0])
    return Cmd(options, required), rest, name


# ---------------------------------------------------------------- finding invocations

@dataclass
class Invocation:
    """``dips`` and the words after it, up to the end of its shell command."""

    where: str  # "deploy/kubernetes/leader.yaml: Deployment/dips-leader, container leader"
    words: list[str]
    container: dict | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        return " ".join(["dips", *self.words])

    def value(self, flag: str) -> str | None:
        for i, word in enumerate(self.words):
            if word == flag and i + 1 < len(self.words):
                return self.words[i + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
        return None


def invocations_in_words(words: list[str], where: str, container: dict | None = None
                         ) -> list[Invocation]:
    """Every ``dips`` word of an argument list or a shell command line, and what follows it
    up to a shell operator (``;``, ``&&``, ``|``, ...)."""
    found = []
    for i, word in enumerate(words):
        if word != "dips":
            continue
        rest = []
        for nxt in words[i + 1:]:
            if OPERATOR.match(nxt):
                break
            rest.append(nxt)
        found.append(Invocation(where, rest, container))
    return found


def shell_lines(script: str) -> Iterator[list[str]]:
    """The words of each logical line of a shell script: comment lines dropped, backslash
    continuations joined, operators split off (``shlex`` with ``punctuation_chars``)."""
    kept = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    for line in "\n".join(kept).replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        yield list(lex)


def invocations_in_script(script: str, where: str, container: dict | None = None
                          ) -> list[Invocation]:
    found: list[Invocation] = []
    for words in shell_lines(script):
        found += invocations_in_words(words, where, container)
    return found


def invocations_in_container(container: dict, where: str) -> list[Invocation]:
    """From ``command`` + ``args``: the list itself (``["dips", "leader", ...]``) and every
    item that is a shell script (``["/bin/sh", "-c", "... exec dips follower ..."]``)."""
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    found = invocations_in_words(argv, where, container)
    for item in argv:
        if any(c.isspace() for c in item):
            found += invocations_in_script(item, where, container)
    return found


def check_invocation(inv: Invocation, group: Any | None = None) -> list[str]:
    """The problems of one invocation, each naming where, the command and the flag."""
    group = group if group is not None else cli_commands()
    cmd, rest, name = describe(group, inv.words)
    if cmd is None:
        known = ", ".join(sorted(group.commands))
        return [f"{inv.where}: `{inv.text}`: `{name}` is not a dips command (commands: {known})"]
    problems = []
    used = set()
    for word in rest:
        if not FLAG.match(word):
            continue
        flag = word.split("=", 1)[0]
        used.add(flag)
        if flag not in cmd.options:
            problems.append(f"{inv.where}: `{name}`: unknown flag {flag} "
                            f"(options of {name}: {', '.join(sorted(cmd.options))})")
    for flag in sorted(cmd.required - used):
        problems.append(f"{inv.where}: `{name}`: required flag {flag} is missing")
    return problems


# ---------------------------------------------------------------- the files

@dataclass
class Doc:
    path: Path
    body: dict

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))

    @property
    def kind(self) -> str:
        return str(self.body.get("kind"))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name"))

    @property
    def namespace(self) -> str:
        return str((self.body.get("metadata") or {}).get("namespace", "default"))

    @property
    def label(self) -> str:
        return f"{self.rel}: {self.kind}/{self.name}"


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def manifests() -> list[Doc]:
    docs = []
    for path in manifest_files():
        with open(path) as f:
            docs += [Doc(path, body) for body in yaml.safe_load_all(f) if body is not None]
    return docs


def pod_specs(node: Any) -> Iterator[dict]:
    """Every pod spec (a mapping with a ``containers`` list) inside a manifest."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield node
        for value in node.values():
            yield from pod_specs(value)
    elif isinstance(node, list):
        for value in node:
            yield from pod_specs(value)


def containers(doc: Doc) -> Iterator[tuple[dict, dict, str]]:
    """(pod spec, container, where) of every container of a manifest."""
    for spec in pod_specs(doc.body):
        for c in (spec.get("initContainers") or []) + spec["containers"]:
            yield spec, c, f"{doc.label}, container {c.get('name')}"


def all_invocations() -> list[Invocation]:
    found = []
    for doc in manifests():
        for _, c, where in containers(doc):
            found += invocations_in_container(c, where)
    found += invocations_in_script(SBATCH.read_text(), str(SBATCH.relative_to(ROOT)))
    return found


def runs(doc: Doc, command: str) -> bool:
    return any(inv.words[:1] == [command]
               for _, c, where in containers(doc) for inv in invocations_in_container(c, where))


def one(docs: list[Doc], what: str) -> Doc:
    assert len(docs) == 1, f"expected exactly one {what}, found {[d.label for d in docs]}"
    return docs[0]


# ---------------------------------------------------------------- tests

def test_files_exist_and_parse():
    names = {p.name for p in manifest_files()}
    for expected in ("configmap-run.yaml", "leader.yaml", "followers.yaml"):
        assert expected in names, f"deploy/kubernetes/{expected} is missing"
    assert (K8S / "README.md").is_file() and SBATCH.is_file()
    assert (SBATCH.parent / "README.md").is_file()
    for path in manifest_files():
        with open(path) as f:
            assert [d for d in yaml.safe_load_all(f) if d is not None], f"{path}: no document"


def test_every_manifest_has_api_version_kind_and_name():
    for doc in manifests():
        assert isinstance(doc.body, dict), f"{doc.rel}: a document is not a mapping"
        for key in ("apiVersion", "kind"):
            assert doc.body.get(key), f"{doc.rel}: a document has no {key} ({doc.body!r:.80})"
        assert (doc.body.get("metadata") or {}).get("name"), f"{doc.label}: no metadata.name"


def test_every_dips_invocation_uses_real_commands_and_flags():
    group = cli_commands()
    found = all_invocations()
    problems = [p for inv in found for p in check_invocation(inv, group)]
    assert not problems, "\n".join(problems)
    # The checker must actually see the role commands (an extractor that finds nothing passes
    # everything): the leader and the followers in Kubernetes, the cluster under Slurm.
    commands = {(inv.where.split(":")[0], inv.words[0] if inv.words else "") for inv in found}
    for expected in [("deploy/kubernetes/leader.yaml", "leader"),
                     ("deploy/kubernetes/followers.yaml", "follower"),
                     ("deploy/slurm/cluster.sbatch", "cluster")]:
        assert expected in commands, f"no `dips {expected[1]}` found in {expected[0]}: {commands}"


def test_listen_ports_are_declared_container_ports():
    problems = []
    checked = 0
    for doc in manifests():
        for _, c, where in containers(doc):
            declared = {p.get("containerPort") for p in c.get("ports") or []}
            for inv in invocations_in_container(c, where):
                for flag in ("--listen", "--data-listen"):
                    value = inv.value(flag)
                    if value is None:
                        continue
                    port = value.rsplit(":", 1)[-1]
                    if not port.isdigit():
                        problems.append(f"{where}: `dips {inv.words[0]}` {flag} {value}: "
                                        "no literal port")
                    elif int(port) not in declared:
                        problems.append(f"{where}: `dips {inv.words[0]}` {flag} {value}: port "
                                        f"{port} is not a containerPort ({sorted(declared)})")
                    checked += 1
    assert checked >= 3, f"expected --listen of the leader and both of a follower, saw {checked}"
    assert not problems, "\n".join(problems)


def test_leader_is_one_deployment_with_recreate():
    docs = manifests()
    leader = one([d for d in docs if runs(d, "leader")], "manifest running `dips leader`")
    assert leader.kind == "Deployment", f"{leader.label}: the leader should be a Deployment"
    spec = leader.body["spec"]
    assert spec.get("replicas") == 1, f"{leader.label}: replicas {spec.get('replicas')}, not 1"
    strategy = (spec.get("strategy") or {}).get("type")
    assert strategy == "Recreate", f"{leader.label}: strategy {strategy}, not Recreate"
    # Its state dir on a PVC of the same file; its run config from a mounted ConfigMap key.
    pod = spec["template"]["spec"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes") or []
              if "persistentVolumeClaim" in v}
    pvcs = {d.name for d in docs if d.kind == "PersistentVolumeClaim"}
    assert claims and claims <= pvcs, f"{leader.label}: claims {claims}, PVCs {pvcs}"
    _, c, where = next(containers(leader))
    inv = next(i for i in invocations_in_container(c, where) if i.words[0] == "leader")
    state = Path(inv.value("--state-dir") or "")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
    by_name = {v["name"]: v for v in pod.get("volumes") or []}
    assert any(state == Path(m) or Path(m) in state.parents for m, n in mounts.items()
               if "persistentVolumeClaim" in by_name[n]), \
        f"{where}: --state-dir {state} is not on a PersistentVolumeClaim mount"
    config = Path(inv.value("--config") or "")
    volume = by_name.get(mounts.get(str(config.parent), ""), {})
    assert "configMap" in volume, f"{where}: --config {config}: its directory is no ConfigMap"
    cm = one([d for d in docs if d.kind == "ConfigMap" and d.name == volume["configMap"]["name"]],
             f"ConfigMap {volume['configMap']['name']}")
    assert config.name in (cm.body.get("data") or {}), f"{cm.label}: no key {config.name}"
    tls = inv.value("--tls")
    assert tls in mounts and "secret" in by_name[mounts[tls]], \
        f"{where}: --tls {tls} is not a Secret mounted as a directory"


def test_followers_are_a_statefulset_with_a_headless_service():
    docs = manifests()
    sts = one([d for d in docs if runs(d, "follower")], "manifest running `dips follower`")
    assert sts.kind == "StatefulSet", f"{sts.label}: the followers should be a StatefulSet"
    spec = sts.body["spec"]
    name = spec.get("serviceName")
    assert name, f"{sts.label}: no serviceName"
    services = [d for d in docs if d.kind == "Service" and d.name == name
                and d.namespace == sts.namespace]
    svc = one(services, f"Service {name} (named by {sts.label} serviceName)")
    assert svc.body["spec"].get("clusterIP") == "None", \
        f"{svc.label}: serviceName of {sts.label} must be headless (clusterIP: None)"
    labels = spec["template"]["metadata"]["labels"]
    selector = svc.body["spec"].get("selector") or {}
    assert selector and selector.items() <= labels.items(), \
        f"{svc.label}: selector {selector} does not select {sts.label}'s pods ({labels})"
    assert spec.get("volumeClaimTemplates"), f"{sts.label}: no volumeClaimTemplates"
    # The index comes from the pod ordinal, and the wrapper assembles the bundle for it.
    script = "\n".join(str(a) for _, c, _ in containers(sts) for a in c.get("args") or [])
    assert "${HOSTNAME##*-}" in script, f"{sts.label}: the index is not the pod ordinal"
    assert "umask 077" in script, f"{sts.label}: the key is copied without umask 077"


def _pods(docs: list[Doc]) -> Iterator[tuple[Doc, dict, list[dict]]]:
    """(workload, labels of one pod, its containers); a StatefulSet's pods also carry the
    statefulset.kubernetes.io/pod-name label its controller sets (ordinals 0..replicas-1)."""
    for doc in docs:
        if doc.kind not in WORKLOADS:
            continue
        template = doc.body["spec"]["template"]
        labels = dict(template["metadata"].get("labels") or {})
        cs = template["spec"]["containers"]
        if doc.kind == "StatefulSet":
            for i in range(int(doc.body["spec"].get("replicas", 1))):
                yield doc, {**labels, "statefulset.kubernetes.io/pod-name": f"{doc.name}-{i}"}, cs
        else:
            yield doc, labels, cs


def test_services_select_pods_and_their_ports():
    docs = manifests()
    problems = []
    for svc in (d for d in docs if d.kind == "Service"):
        selector = svc.body["spec"].get("selector") or {}
        pods = [(w, cs) for w, labels, cs in _pods(docs)
                if w.namespace == svc.namespace and selector.items() <= labels.items()]
        if not pods:
            problems.append(f"{svc.label}: selector {selector} selects no pod")
            continue
        for port in svc.body["spec"].get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            for w, cs in pods:
                declared = {p.get("name") for c in cs for p in c.get("ports") or []} | \
                           {p.get("containerPort") for c in cs for p in c.get("ports") or []}
                if target not in declared:
                    problems.append(f"{svc.label}: targetPort {target} is not a port of "
                                    f"{w.label}")
    assert not problems, "\n".join(problems)


def test_run_config_validates_and_matches_the_followers(tmp_path):
    from dips.spec import load_config

    docs = manifests()
    cm = one([d for d in docs if d.kind == "ConfigMap" and "run.yaml" in
              (d.body.get("data") or {})], "ConfigMap with run.yaml")
    path = tmp_path / "run.yaml"
    path.write_text(cm.body["data"]["run.yaml"])
    cfg = load_config(path)
    sts = one([d for d in docs if runs(d, "follower")], "manifest running `dips follower`")
    assert sts.body["spec"].get("replicas") == cfg.followers, \
        f"{sts.label}: replicas {sts.body['spec'].get('replicas')}, but {cm.label} run.yaml " \
        f"has followers: {cfg.followers}"


def test_sbatch_starts_one_task_and_nothing_that_does_not_exist_yet():
    text = SBATCH.read_text()
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for option in ("--nodes", "--time"):
        assert any(option in d for d in directives), f"{SBATCH.name}: no #SBATCH {option}"
    assert any("--gpus" in d for d in directives), f"{SBATCH.name}: no #SBATCH GPU line"
    srun = [words for words in shell_lines(text) if "srun" in words and "dips" in words]
    assert srun, f"{SBATCH.name}: no `srun ... dips ...` line"
    for words in srun:
        before = words[:words.index("dips")]
        assert "--ntasks=1" in before, f"{SBATCH.name}: srun without --ntasks=1: {words}"
    for words in shell_lines(text):
        assert "torchrun" not in " ".join(words), \
            f"{SBATCH.name}: torchrun outside a comment (not supported yet): {words}"
    for var in ("DIPS_LEADER", "DIPS_CLUSTER_ID"):
        assert f'"${var}"' in text, f"{SBATCH.name}: ${var} is not passed to dips cluster"



def test_shell_scripts_parse():
    """``bash -n`` / ``sh -n`` (syntax only, nothing runs) on the Slurm script and on every
    script a container runs with ``sh -c`` / ``bash -c``: shlex above is not a shell."""
    scripts = [(["bash", "-n", str(SBATCH)], str(SBATCH.relative_to(ROOT)), None)]
    for doc in manifests():
        for _, c, where in containers(doc):
            argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
            for i, word in enumerate(argv[:-1]):
                if Path(word).name in ("sh", "bash") and argv[i + 1] == "-c" and i + 2 < len(argv):
                    scripts.append(([Path(word).name, "-n"], where, argv[i + 2]))
    assert len(scripts) >= 2, "expected the follower wrapper script"
    for argv, where, stdin in scripts:
        if shutil.which(argv[0]) is None:
            pytest.skip(f"{argv[0]} is not installed")
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30,
                              check=False)
        assert done.returncode == 0, f"{where}: {' '.join(argv)}: {done.stderr.strip()}"


# ---------------------------------------------------------------- the checker itself

@pytest.mark.parametrize("script, expected", [
    ("dips leader --bogus 1", "unknown flag --bogus"),
    ("exec dips follower --index 0 --listen 0.0.0.0:7100 --data-lissen 0.0.0.0:7200",
     "unknown flag --data-lissen"),
    ("srun --ntasks=1 dips cluster --leader x:7000 --cluster-id a --state-dir s --gpus=2",
     "unknown flag --gpus"),
    ("dips lead --config x", "`dips lead` is not a dips command"),
    ("dips follower --leader x:7000 --index 0", "required flag --listen is missing"),
])
def test_checker_reports_bad_invocations(script, expected):
    found = invocations_in_script(script, "<self-check>")
    assert len(found) == 1, found
    problems = check_invocation(found[0])
    assert any(expected in p and p.startswith("<self-check>") for p in problems), problems


def test_checker_reads_containers_and_ignores_comments():
    container = {"name": "x", "command": ["/bin/sh", "-c"],
                 "args": [("# dips leader --not-checked\nset -e\nexec dips leader \\\n"
                           "  --bogus 1 && echo 'dips leader --quoted'")]}
    found = invocations_in_container(container, "<self-check>")
    assert [inv.words for inv in found] == [["leader", "--bogus", "1"]]
    assert any("unknown flag --bogus" in p for p in check_invocation(found[0]))
    listed = invocations_in_container({"command": ["dips", "leader", "--listen=0.0.0.0:1"]}, "w")
    assert listed[0].value("--listen") == "0.0.0.0:1"
