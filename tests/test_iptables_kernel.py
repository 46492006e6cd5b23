"""The in-memory iptables kernel agrees with the real one (iptables-legacy and iptables-nft, in a
throwaway namespace): the same payloads are accepted or refused, and leave the same rules.

"The same rules" is `tests.iptables_sync.meaning`: both dumps read by analysis.iptables_save,
since iptables-save re-spells what iptables-restore read (option order, `/32`, 11-digit
probabilities) and the in-memory kernel keeps the spelling it was given.
"""

from __future__ import annotations

import random

import pytest

from nfproxy.core.model import IPFamily
from nfproxy.kernel.iptables import Flavour, IptablesKernel, IptablesRunner
from nfproxy.kernel.memory.iptables import MemoryIptablesKernel
from nfproxy.kernel.process import KernelError
from nfproxy.testing import random_cluster
from tests.iptables_sync import OneFamily, meaning
from tests.test_iptables_plan import RESTORE_CASES
from tests.test_proxier import mutate

pytestmark = pytest.mark.kernel


def agree(fake: MemoryIptablesKernel, real: IptablesKernel, family: IPFamily, step: str) -> None:
    assert fake.owned() == real.owned(), step
    assert meaning(fake.dump(), family) == meaning(real.dump(), family), step


@pytest.mark.parametrize("flavour", list(Flavour))
def test_restore_verdicts_agree(netns: str, flavour: Flavour) -> None:
    fake, real = MemoryIptablesKernel(), IptablesKernel(IPFamily.V4, netns, flavour)
    for name, text, ok in RESTORE_CASES:
        verdicts = []
        for kernel in (fake.restore, real.runner.restore):
            try:
                kernel(text)
                verdicts.append(True)
            except KernelError:
                verdicts.append(False)
        assert verdicts == [ok, ok], name
        agree(fake, real, IPFamily.V4, name)


@pytest.mark.parametrize("family", list(IPFamily))
@pytest.mark.parametrize("flavour", list(Flavour))
def test_sync_sequences_on_random_clusters_agree(netns: str, flavour: Flavour, family: IPFamily) -> None:
    """Full, partial syncs, a restart's full sync that removes leftovers, and jumps ensured
    twice: after each payload both kernels hold the same rules."""
    fake, real = MemoryIptablesKernel(family), IptablesKernel(family, netns, flavour)
    for seed in range(2):
        rng = random.Random(seed)
        state = random_cluster(rng, 18, 8)
        pool = random_cluster(random.Random(seed + 50), 26, 8)
        node = OneFamily(fake, family)  # a restart for every seed after the first
        for step in range(10):
            plan = node.sync(state)
            if plan is not None:
                real.apply(plan.payload)
            agree(fake, real, family, f"seed {seed} step {step}")
            state = mutate(rng, state, pool)


def test_refused_restore_leaves_the_real_table_unchanged(netns: str) -> None:
    real = IptablesKernel(IPFamily.V4, netns, Flavour.NFT)
    real.runner.restore("*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j RETURN\nCOMMIT\n")
    before = real.dump()
    with pytest.raises(KernelError):
        real.runner.restore("*nat\n:KUBE-SVC-X - [0:0]\n-A KUBE-SVC-X -j KUBE-MISSING\nCOMMIT\n")
    assert real.dump() == before


@pytest.mark.parametrize("flavour", list(Flavour))
def test_a_resync_reuses_its_listing_for_the_jumps(netns: str, flavour: Flavour, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full sync reads the built-in chains from the listing it makes anyway: a jump to a chain
    nothing in its built-in chain reaches goes in with the restore (each `iptables -C` or `-I`
    loads the whole table: 308 MiB at 10 000 x 10), once the jumps are in a resync runs no
    `iptables -C`, and no jump is ever duplicated."""
    from nfproxy.backends.iptables.render import JUMPS
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.kernel import iptables as kernel_iptables
    from nfproxy.testing import uniform_cluster

    argvs: list[list[str]] = []
    real_run = kernel_iptables.run

    def recording(argv, **kw):  # noqa: ANN001, ANN003, ANN202
        argvs.append(list(argv))
        return real_run(argv, **kw)

    monkeypatch.setattr(kernel_iptables, "run", recording)
    proxier = Proxier("iptables", netns=netns, families=(IPFamily.V4,), flavour=flavour)
    state = uniform_cluster(3, 2)
    proxier.sync(state)
    first = [a for a in argvs if "-C" in a]
    argvs.clear()
    proxier.sync(state, full=True)
    assert first == []
    assert not [a for a in argvs if "-C" in a or "-I" in a]
    save = proxier.kernels[IPFamily.V4].runner.save()
    for jump in JUMPS:
        assert save.count(jump.line) == 1, jump.line
    # One `-I CHAIN 1` after another leaves them in kube-proxy's order, as on its nodes.
    for table in ("filter", "nat"):
        listed = proxier.kernels[IPFamily.V4].runner.save(table).splitlines()
        for chain in {j.chain for j in JUMPS if j.table == table}:
            ours = [line for line in listed if line.startswith(f"-A {chain} ")]
            assert ours == [j.line for j in JUMPS if j.table == table and j.chain == chain], (table, chain)


@pytest.mark.kernel
@pytest.mark.parametrize("flavour", list(Flavour))
def test_a_jump_that_may_be_there_in_another_spelling_is_checked(netns: str, flavour: Flavour, monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in chain that already reaches our chain (someone's rule, another spelling) gets
    the check-then-insert, as kube-proxy's EnsureRule: the restore does not insert blindly."""
    from nfproxy.backends.iptables.render import JUMPS
    from nfproxy.daemon.proxier import Proxier
    from nfproxy.kernel import iptables as kernel_iptables
    from nfproxy.testing import uniform_cluster

    runner = IptablesRunner(IPFamily.V4, netns, flavour)
    runner.restore("*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -m comment --comment other -j KUBE-SERVICES\nCOMMIT\n")
    checked: list[list[str]] = []
    real_run = kernel_iptables.run

    def recording(argv, **kw):  # noqa: ANN001, ANN003, ANN202
        if "-C" in argv:
            checked.append(list(argv))
        return real_run(argv, **kw)

    monkeypatch.setattr(kernel_iptables, "run", recording)
    Proxier("iptables", netns=netns, families=(IPFamily.V4,), flavour=flavour).sync(uniform_cluster(3, 2))
    assert [a[a.index("-C") + 1] for a in checked] == ["PREROUTING"]  # only the chain that reached it
    save = runner.save("nat")
    assert "-A PREROUTING -m comment --comment other -j KUBE-SERVICES" in save
    for jump in JUMPS:
        if jump.table == "nat":
            assert save.count(jump.line) == 1, jump.line
