"""Request bodies: the walk over every part of a JSON body (`walk`), the tables it
applies (`rules`), and the inspector that resolves the media it found (`inspector`)."""

from gateway.payload.inspector import Inspection, PayloadInspector
from gateway.payload.settings import CacheIsolation, PayloadSettings

__all__ = ["CacheIsolation", "Inspection", "PayloadInspector", "PayloadSettings"]
