"""The fused worker's check of its consumer group's members (workers.handoff, topology.groups), without a broker:
the consumer protocol's member metadata decoded, and which members count as four-stage workers."""

from __future__ import annotations

from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

from topology.groups import GroupMember, subscription
from workers.handoff import FUSED_CLIENT_ID, four_stage_members

STAGE_TOPICS = ("stam.extracted.v1", "stam.linked.v1", "stam.impacted.v1")
UUID = "ab6b3ecf-9994-48e8-aa99-005b6703a99f"


def _metadata(*topics: str) -> bytes:
    """What a consumer sends when it joins (Faust's assignor: version, topics, its own user data)."""
    return bytes(ConsumerProtocolMemberMetadata(4, list(topics), b'{"assignment": {}}').encode())


def test_the_member_metadata_gives_the_subscribed_topics() -> None:
    assert subscription(_metadata("stam.entries.v1", "stam.linked.v1")) == ("stam.entries.v1", "stam.linked.v1")
    assert subscription(_metadata()) == ()
    assert subscription(bytes.fromhex("0000" "00000001" "0004") + b"abcd" + bytes.fromhex("ffffffff")) == ("abcd",)


def test_no_metadata_or_another_protocols_bytes_is_an_unknown_subscription() -> None:
    assert subscription(b"") is None  # Tansu sends none
    assert subscription(b"\x00") is None  # truncated, or not the consumer protocol's


def test_a_members_client_is_its_client_id_or_the_head_of_its_member_id() -> None:
    assert GroupMember(f"{FUSED_CLIENT_ID}-{UUID}", "", None).client == FUSED_CLIENT_ID  # Tansu: no client id
    assert GroupMember(f"faust-0.11.3-{UUID}", "", None).client == "faust-0.11.3"
    assert GroupMember(f"x-{UUID}", "stam-fused", None).client == "stam-fused"  # Kafka names it
    assert GroupMember("no-uuid-here", "", None).client == "no-uuid-here"


def test_a_member_reading_a_stage_topic_is_a_four_stage_worker() -> None:
    four = GroupMember(f"faust-0.11.3-{UUID}", "faust-0.11.3",
                       subscription(_metadata("stam.entries.v1", "stam.extracted.v1", "stam.deletions.v1")))
    fused = GroupMember(f"{FUSED_CLIENT_ID}-{UUID}", FUSED_CLIENT_ID,
                        subscription(_metadata("stam.entries.v1", "stam.deletions.v1")))
    # Known subscriptions decide, whatever the client id: an older fused worker with Faust's client id passes.
    older_fused = GroupMember(f"faust-0.11.3-{UUID}", "faust-0.11.3", subscription(_metadata("stam.entries.v1")))
    assert four_stage_members([four, fused, older_fused], STAGE_TOPICS) == [four]


def test_without_subscriptions_every_member_not_known_to_be_fused_counts() -> None:
    fused = GroupMember(f"{FUSED_CLIENT_ID}-{UUID}", "", None)
    other = GroupMember(f"faust-0.11.3-{UUID}", "", None)
    assert four_stage_members([fused], STAGE_TOPICS) == []
    assert four_stage_members([fused, other], STAGE_TOPICS) == [other]
    assert four_stage_members([], STAGE_TOPICS) == []
