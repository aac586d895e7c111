"""FHIR topic-based Subscriptions: STAM's state transitions out as R4B (Subscriptions R5 Backport IG) and R5
notification Bundles (``stam listen fhir``).

- :mod:`stam.fhir.resources`: a memory and its transition as FHIR resources (R4B or R5) and their Provenance;
- :mod:`stam.fhir.topics`: the SubscriptionTopics, one per kind of transition, and which transitions they match;
- :mod:`stam.fhir.subscriptions`: a Subscription as a subscriber posts it (R4B backport or R5), checked;
- :mod:`stam.fhir.bundles`: notification, ``$status`` and ``$events`` Bundles;
- :mod:`stam.fhir.store`: Subscriptions, event numbers and kept events in the stack's Redis;
- :mod:`stam.fhir.notifier`: the transitions topic (a consumer group) to numbered events, and their delivery
  (handshake, heartbeat, retries) to rest-hook endpoints;
- :mod:`stam.fhir.server`: the REST endpoint (aiohttp, base ``/fhir``);
- :mod:`stam.fhir.validate`: the checks the tests and the evidence script run on every Bundle.
"""
