"""The media digests an inspection found, in body order, without their paths."""

from gateway.payload.inspector import Inspection


def digests(inspection: Inspection) -> list[str]:
    return [digest for _, digest in inspection.media]
