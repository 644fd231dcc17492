"""The persistent semaphore: `A` queues are slots, exclusive `B` queues are holders."""

from .admin import Removal, SemaphoreAdmin
from .client import PersistentSemaphore

__all__ = ["PersistentSemaphore", "Removal", "SemaphoreAdmin"]
