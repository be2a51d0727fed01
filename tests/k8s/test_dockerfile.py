"""The Dockerfile, checked without a Docker engine: instructions, stages, what it copies,
the entrypoint the manifests rely on, and the build context .dockerignore leaves."""

from __future__ import annotations

import fnmatch
import json
import re

import pytest

from k8s_support import K8S, REPO, load_docs

DOCKERFILE = REPO / "Dockerfile"
PKI_DOCKERFILE = K8S / "etcd" / "pki" / "Dockerfile"
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def instructions(path=DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends in a continuation line"
    return out


def stages(path=DOCKERFILE) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_instructions_are_known_and_from_comes_first():
    ins = instructions()
    for word, _ in ins:
        assert word in INSTRUCTIONS, f"unknown instruction {word}"
    first = [w for w, _ in ins if w != "ARG"][0]
    assert first == "FROM"


@pytest.mark.parametrize("path", [DOCKERFILE, PKI_DOCKERFILE], ids=["Dockerfile", "k8s/etcd/pki/Dockerfile"])
def test_base_images_are_pinned_and_stages_resolve(path):
    args = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args.setdefault(k, v.strip('"'))
    names = set()
    for stage in stages(path):
        image = stage[0][1].split()
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image[0])
        if ref not in names:
            assert ":" in ref and not ref.endswith(":latest"), f"pin the base image tag: {ref}"
        if len(image) == 3 and image[1].upper() == "AS":
            names.add(image[2])
    final = stages(path)[-1]
    for word, rest in final:
        m = re.match(r"--from=(\S+)", rest)
        if word == "COPY" and m:
            assert m.group(1) in names, f"COPY --from={m.group(1)}: no such stage"


def test_entrypoint_is_tini_exec_form_and_cmd_runs_elastic_rt():
    final = dict((w, r) for w, r in stages()[-1])
    entry = json.loads(final["ENTRYPOINT"])
    assert entry[0].endswith("/tini") and entry[-1] == "--", "tini as PID 1 forwards SIGTERM and reaps orphans"
    assert any(w == "RUN" and "install" in r and " tini" in r for w, r in stages()[-1]), "install tini in the final stage"
    cmd = json.loads(final["CMD"])
    assert cmd[0] == "elastic-rt"


@pytest.mark.parametrize("path", [DOCKERFILE, PKI_DOCKERFILE], ids=["Dockerfile", "k8s/etcd/pki/Dockerfile"])
def test_copies_exist_in_the_repository(path):
    for stage in stages(path):
        for word, rest in stage:
            if word not in ("COPY", "ADD") or rest.startswith("--from"):
                continue
            *sources, _dest = [p for p in rest.split() if not p.startswith("--")]
            for s in sources:
                assert (REPO / s).exists(), f"{word} {s}: not in the repository (docker build would fail)"


def test_runs_as_the_user_the_manifests_expect():
    final = stages()[-1]
    users = [r for w, r in final if w == "USER"]
    assert users and users[-1].split(":")[0] == "1000"
    job = load_docs(K8S / "job" / "job.yaml")[0]
    sc = job["spec"]["template"]["spec"]["securityContext"]
    assert sc["runAsUser"] == 1000 and sc["runAsNonRoot"] is True


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for p in patterns:
            neg = p.startswith("!")
            pat = p[1:] if neg else p
            pat = pat.rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[0], pat) or \
                    fnmatch.fnmatch(path, pat + "/*"):
                result = not neg
        return result

    for needed in ("pyproject.toml", "README.md", "elastic_rt/cli.py", "launch/train_example.py",
                   "launch/elastic-rt-hosts.sh"):
        assert not ignored(needed), f".dockerignore drops {needed}"
    assert ignored("checkpoints/x") and ignored(".git/config")


def test_the_pki_image_is_what_the_pki_jobs_run():
    """The etcd-pki Jobs run etcd-pki.sh from this image, with etcdctl of the members' version, kubectl and
    openssl in it, as a non-root user."""
    final = stages(PKI_DOCKERFILE)[-1]
    entry = json.loads(dict(final)["ENTRYPOINT"])
    assert entry == ["/usr/local/bin/etcd-pki.sh"]
    copies = [r for w, r in final if w == "COPY"]
    assert "launch/etcd-pki.sh /usr/local/bin/etcd-pki.sh" in copies
    assert any(c.endswith("/usr/local/bin/etcdctl") for c in copies) and any(c.endswith("/usr/local/bin/kubectl")
                                                                            for c in copies)
    assert any(w == "RUN" and "openssl" in r for w, r in final)
    users = [r for w, r in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    args = dict(r.split("=", 1) for w, r in instructions(PKI_DOCKERFILE) if w == "ARG" and "=" in r)
    sts = [d for d in load_docs(K8S / "etcd" / "statefulset.yaml") if d["kind"] == "StatefulSet"][0]
    assert args["ETCD_IMAGE"].rsplit(":", 1)[1] == sts["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[1]
    for path in (K8S / "etcd" / "pki-job.yaml", K8S / "job" / "etcd-user-job.yaml"):
        for job in [d for d in load_docs(path) if d["kind"] == "Job"]:
            c = job["spec"]["template"]["spec"]["containers"][0]
            assert c["image"].split(":")[0] == "elastic-rt-etcd-pki" and c["command"][0] == entry[0]
