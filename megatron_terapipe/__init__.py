"""megatron-terapipe: TeraPipe token-level pipeline parallelism for Megatron-Core."""

from .plan import TeraPipePlan
from .schedule import Action, Cell, Schedule, ScheduleError, build_schedule, timeline, validate

__version__ = "0.1.0"
