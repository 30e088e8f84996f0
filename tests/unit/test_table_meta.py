"""Table.meta is a typed, immutable NamedTuple per table kind (NO_META for a table without one)."""
import pytest

from analysis.analyzers.collective_calls import ExpectedCollectivesMeta
from analysis.analyzers.curves import CurvesMeta
from analysis.analyzers.memory import MemoryVsPlanMeta
from analysis.analyzers.steps import MegatronStepsMeta, StepStatisticsMeta
from analysis.analyzers.trace_analysis import KernelDiffMeta, ScopeMeta, StragglersMeta
from analysis.parsers.deepspeed_log import DeepSpeedLogMeta
from analysis.parsers.kineto import KinetoMeta, KinetoRanksMeta
from analysis.parsers.megatron_log import MegatronLogMeta
from analysis.parsers.metrics import _SHARED_META, MetricsMeta
from analysis.parsers.nccl_debug import NcclDebugMeta
from analysis.parsers.nccl_tests import NcclTestsMeta, NcclTestsSection
from analysis.parsers.nsys import NsysMeta
from analysis.parsers.nsys_stats import NsysStatsMeta
from analysis.parsers.tensorboard import TensorBoardMeta
from analysis.table import NO_META, NoMeta, Table

META_TYPES = (NoMeta, KinetoMeta, KinetoRanksMeta, NsysMeta, NsysStatsMeta, MegatronLogMeta, DeepSpeedLogMeta,
              TensorBoardMeta, MetricsMeta, NcclTestsSection, NcclTestsMeta, NcclDebugMeta, ScopeMeta, KernelDiffMeta,
              StragglersMeta, ExpectedCollectivesMeta, MemoryVsPlanMeta, CurvesMeta, MegatronStepsMeta,
              StepStatisticsMeta)


@pytest.mark.parametrize("kind", META_TYPES, ids=lambda k: k.__name__)
def test_every_meta_is_a_documented_immutable_named_tuple(kind):
    assert issubclass(kind, tuple) and isinstance(kind._fields, tuple) and kind.__doc__
    assert set(kind.__annotations__) == set(kind._fields)
    value = kind(**{f: None for f in kind._fields})
    with pytest.raises(AttributeError):
        value.__setattr__(kind._fields[0] if kind._fields else "x", 1)


def test_metas_that_mirror_other_records_name_the_same_fields():
    assert NcclTestsMeta._fields == ("ops", "sections") + NcclTestsSection._fields
    assert MetricsMeta._fields == ("ranks", "files", "resumes", "schema_version") + _SHARED_META + ("checkpoints",)


def test_table_holds_its_meta_through_from_rows_and_where():
    doc = {"a": "a number"}
    plain = Table.from_rows("t", doc, [{"a": 1}, {"a": 2}])
    assert plain.meta is NO_META and plain.where(a=1).meta is NO_META
    meta = CurvesMeta(not_finite_loss=3)
    t = Table.from_rows("t", doc, [{"a": 1}, {"a": 2}], meta=meta)
    assert t.meta is meta and t.where(a=2).meta is meta and t.meta.not_finite_loss == 3
    assert t == Table.from_rows("t", doc, [{"a": 1}, {"a": 2}], meta=CurvesMeta(3))
    # equal values of another kind are another meta (NamedTuples compare as plain tuples)
    assert t != Table.from_rows("t", doc, [{"a": 1}, {"a": 2}], meta=KernelDiffMeta(3))
    with pytest.raises(TypeError, match="NamedTuple"):
        Table.from_rows("t", doc, [], meta={"not_finite_loss": 3})
