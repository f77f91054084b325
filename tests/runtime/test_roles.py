"""Both runtimes implement the roles the trainer loop drives (rlhf.core.protocols.roles): the local workers
and the Ray group handles have every method and attribute of their protocol."""

from __future__ import annotations

import pytest

from rlhf.core.protocols import roles
from rlhf.core.plugin_host.contracts import missing_members, protocol_members
from rlhf.runtime.rl import rollout, workers
from rlhf.runtime.ray import groups

pytestmark = pytest.mark.unit

CASES = [
    (roles.PolicyRole, workers.PolicyWorker, groups.PolicyGroup),
    (roles.CriticRole, workers.CriticWorker, groups.CriticGroup),
    (roles.ReferenceRole, workers.ReferenceWorker, groups.ReferenceGroup),
    (roles.ReferenceRole, workers.ReferenceWorker, groups.TeacherGroup),  # --teacher: a reference of its own
    (roles.RolloutRole, rollout.RolloutWorker, groups.RolloutGroup),
    (roles.RewardRole, workers.RewardWorker, groups.RewardGroup),
]


@pytest.mark.parametrize("protocol, local, ray", CASES, ids=[c[0].__name__ for c in CASES])
def test_local_workers_and_ray_groups_implement_the_role(protocol, local, ray):
    assert protocol_members(protocol)  # the protocol says something
    assert missing_members(local, protocol) == [], local
    assert missing_members(ray, protocol) == [], ray


def test_a_class_missing_a_member_is_reported():
    class HalfPolicy:
        def logprobs(self, batch):
            return batch

    assert missing_members(HalfPolicy, roles.PolicyRole) == ["fit", "load", "nonfinite_in_a_row", "save"]
