"""Task registry: name -> class. Each name has one `configs/task/<name>.yaml`."""
from tasks.base import Batch, Task
from tasks.copy import Copy
from tasks.retrieval import AssociativeRecall, Passkey
from tasks.reverse import Reverse
from tasks.sort import Sort
from tasks.wikitext import WikiText

REGISTRY: dict[str, type[Task]] = {cls.name: cls for cls in (Copy, Reverse, Sort, WikiText, Passkey, AssociativeRecall)}

__all__ = ["REGISTRY", "Batch", "Task"]
