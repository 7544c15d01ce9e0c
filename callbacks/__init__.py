from .staircase import StaircaseEvaluation

__all__ = ["StaircaseEvaluation"]
