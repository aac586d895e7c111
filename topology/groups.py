"""Who is in a consumer group: its live members, each with its client id and, where the broker says, the topics it
subscribed to (the consumer protocol's member metadata)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.errors import for_code

from stam.config import Settings
from stam.transport import kafka_admin

_MEMBER_ID = re.compile(r"(.*)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class GroupMember:
    """One live member of a consumer group, as DescribeGroups answers it."""

    member_id: str
    client_id: str
    """The client id the member gave; "" where the broker leaves it out (Tansu does)."""
    subscription: tuple[str, ...] | None
    """The topics it subscribed to; None where the broker sends no member metadata (Tansu sends none)."""

    @property
    def client(self) -> str:
        """The member's client id; where the broker leaves it out, the one its member id starts with (Kafka and
        Tansu make a member id as ``<client id>-<uuid>``)."""
        if self.client_id:
            return self.client_id
        made = _MEMBER_ID.fullmatch(self.member_id)
        return made.group(1) if made else self.member_id


def subscription(metadata: bytes) -> tuple[str, ...] | None:
    """The topics of a consumer-protocol member metadata (version int16, an array of topic names, user data);
    None for empty bytes (a broker that does not send the metadata) or bytes that are not that protocol's."""
    if not metadata:
        return None
    try:
        decoded = ConsumerProtocolMemberMetadata.decode(metadata)
    except Exception:  # noqa: BLE001 - another protocol's bytes (or truncated): the subscription is not known
        return None
    return tuple(decoded.subscription)


async def group_members(settings: Settings, group: str) -> list[GroupMember]:
    """The live members of consumer group ``group`` (none for a group that is empty or has never existed).
    Broker errors are raised (``KafkaError``)."""
    admin = kafka_admin(settings)
    try:  # closed too when it fails to start (aiokafka leaves its connections open otherwise)
        await admin.start()
        # One group per request: Tansu answered a request for two groups with the second one's fields shifted.
        answers = await admin.describe_consumer_groups([group])
    finally:
        await admin.close()
    members: list[GroupMember] = []
    for answer in answers:
        for described in answer.to_object()["groups"]:  # by field name: later versions add fields in between
            if described["error_code"]:
                raise for_code(described["error_code"])(f"describing consumer group {group}")
            members += [GroupMember(member_id=m["member_id"], client_id=m["client_id"] or "",
                                    subscription=subscription(m["member_metadata"]))
                        for m in described["members"]]
    return members
