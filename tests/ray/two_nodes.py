"""The driver of tests/ray/test_two_nodes.py, run as a process of its own so the test session's Ray
connection stays as it is: ``python -m tests.ray.two_nodes REPORT -- RLHF_TRAIN_ARGS...``.

It starts a two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head node with
the custom resource ``node_a`` and a second node with ``node_b``, one CPU each, files under
``RAY_TMPDIR``), runs ``rlhf train --ray-address HEAD RLHF_TRAIN_ARGS...`` in this process, and
writes REPORT (JSON): each node's id and custom resources, the node of the driver and of every
actor, and the bytes of what the driver moves between roles each step, as Ray stores it:

* ``weights``: per sync, the policy's trainable parameters that each rollout actor loads (tensor
  bytes) and ``weights_payload``, the object-store object holding them (its pickle);
* ``prompts`` and ``trajectories``: the arguments of each ``rollout.generate`` call and what the
  rollout actors return;
* ``score_args``/``score_result``: the trajectories sent to the reward sources and their scores;
* ``batches``: the experience batch each data-parallel role receives (``[role, method, bytes]``).

The cluster is shut down at the end, even after an error (it stops only the processes it started).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NODE_RESOURCES = ({"node_a": 1.0}, {"node_b": 1.0})


def payload_bytes(value: Any) -> int:
    """The bytes Ray stores for ``value``: its pickle (protocol 5, as Ray's serializer) plus the
    buffers pickled out of band."""
    import ray

    buffers: list[Any] = []
    data = ray.cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(data) + sum(buffer.raw().nbytes for buffer in buffers)


def record(report: dict[str, Any]) -> None:
    """Wrap the driver's calls to note where the actors run and what each call moves."""
    import ray

    from rlhf.runtime.ray import driver, groups

    for key in ("weights", "weights_payload", "prompts", "trajectories", "score_args", "score_result", "batches"):
        report[key] = []
    launch = driver.launch

    def launch_and_note(layout, config, num_prompts, plugins, cluster):
        hosts = launch(layout, config, num_prompts, plugins, cluster)
        report["driver_node"] = ray.get_runtime_context().get_node_id()
        report["nodes"] = {node["NodeID"]: sorted(k for k in node["Resources"] if k.startswith("node_"))
                           for node in ray.nodes() if node["Alive"]}
        report["hosts"] = [{"group": h.group, "rank": h.rank, "node_id": h.info["node_id"]} for h in hosts]
        return hosts

    driver.launch = launch_and_note

    generate, score, on_all = groups.RolloutGroup.generate, groups.RewardGroup.score, groups.RoleGroup._on_all
    sync, weights_refs = groups.RolloutGroup.sync_weights, groups.PolicyGroup.weights_refs

    def generate_and_note(self, prompts, *, n, params):
        report["prompts"].append(payload_bytes((prompts, n, params)))
        trajectories = generate(self, prompts, n=n, params=params)
        report["trajectories"].append(payload_bytes(trajectories))
        return trajectories

    def score_and_note(self, trajectories):
        report["score_args"].append(payload_bytes(trajectories))
        result = score(self, trajectories)
        report["score_result"].append(payload_bytes(result))
        return result

    def on_all_and_note(self, method, *args, **kwargs):
        for arg in args:
            if groups._is_batch(arg):
                report["batches"].append([self.role, method, payload_bytes(arg)])
        return on_all(self, method, *args, **kwargs)

    def refs_and_note(self):
        answers = weights_refs(self)
        report["weights_payload"].append(payload_bytes(ray.get(answers[0][1])))  # read here, for its size only
        return answers

    def sync_and_note(self):
        sync(self)
        report["weights"].append(self.last_sync["bytes"])

    groups.RolloutGroup.generate, groups.RewardGroup.score = generate_and_note, score_and_note
    groups.RoleGroup._on_all, groups.PolicyGroup.weights_refs = on_all_and_note, refs_and_note
    groups.RolloutGroup.sync_weights = sync_and_note


def main(report_path: str, train_args: list[str]) -> int:
    from ray.cluster_utils import Cluster

    from rlhf.cli.main import main as rlhf

    report: dict[str, Any] = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": NODE_RESOURCES[0],
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources=NODE_RESOURCES[1])
        cluster.wait_for_nodes()
        record(report)
        try:
            rlhf(["train", "--ray-address", cluster.address, *train_args])
        except SystemExit as exc:
            report["exit_code"] = exc.code or 0
    finally:
        Path(report_path).write_text(json.dumps(report, indent=1))
        cluster.shutdown()
    return int(report.get("exit_code", 1))


if __name__ == "__main__":
    separator = sys.argv.index("--")
    sys.exit(main(sys.argv[1], sys.argv[separator + 1:]))
