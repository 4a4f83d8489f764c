"""Task registry: name -> class. Each name has one `configs/task/<name>.yaml`."""
from tasks.arithmetic import (Addition, BinaryAddition, CycleNavigation, ModularArithmetic, Parity,
                              PolynomialEvaluation, Summation)
from tasks.base import Batch, Task
from tasks.copy import Copy
from tasks.frontier import Counting, FlipFlop, SelectiveCopy, StateTracking
from tasks.grid import GridFlip, GridNearest, GridRowCount, Life
from tasks.lego import Lego
from tasks.retrieval import MQAR, AssociativeRecall, Passkey
from tasks.reverse import Reverse
from tasks.sort import Sort
from tasks.stack_manipulation import StackManipulation
from tasks.strings import BucketSort, Duplicate, EvenPairs, MissingDuplicate, OddsFirst
from tasks.wikitext import WikiText

LENGTH_GENERALISATION = (  # Kazemnejad et al. 2023; Deletang et al. 2022 / Ruoss et al. 2023
    Addition, Summation, Parity, PolynomialEvaluation, Duplicate, Lego,
    EvenPairs, ModularArithmetic, CycleNavigation, StackManipulation, BucketSort, BinaryAddition,
    MissingDuplicate, OddsFirst,
)
FRONTIER = (FlipFlop, SelectiveCopy, Counting, StateTracking, MQAR)  # the 2024-26 papers' probes (tasks/frontier.py)
GRID = (Life, GridFlip, GridRowCount, GridNearest)  # position_dims = 2: trained at N x N, evaluated at kN x kN
REGISTRY: dict[str, type[Task]] = {cls.name: cls for cls in (Copy, Reverse, Sort, WikiText, Passkey, AssociativeRecall,
                                                             *LENGTH_GENERALISATION, *FRONTIER, *GRID)}

__all__ = ["REGISTRY", "Batch", "Task"]
