"""Server optimizers: parity with Flower 1.42's strategies (live when flwr is installed, and
against outputs recorded from it), Nesterov against torch's SGD, exact resume from saved
state, and the validation of hyper-parameters, inputs and states."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorswap.errors
from tensorswap.aggregate import (
    SERVER_OPTIMIZERS,
    InvalidServerOptimizer,
    InvalidServerRound,
    InvalidServerStepInput,
    ServerOptimizerKind,
    ServerOptimizerStateMismatch,
    server_optimizer,
)
from tensorswap.aggregate.server_opt import kernels
from tensorswap.errors import AggregationError

# --- flower driver (also run by hand in a venv with flwr==1.42.0 to record GOLDEN) ---
SHAPES = {"layer.weight": (3, 4), "layer.bias": (5,)}
ROUNDS = 3
CASES = {
    "fedavg": ("FedAvg", {}),
    "fedavgm-defaults": ("FedAvgM", {}),
    "fedavgm-lr": ("FedAvgM", {"server_learning_rate": 0.5}),
    "fedavgm-momentum": ("FedAvgM", {"server_learning_rate": 0.8, "server_momentum": 0.9}),
    "fedadam": ("FedAdam", {}),
    "fedadam-tuned": ("FedAdam", {"eta": 0.05, "beta_1": 0.5, "beta_2": 0.9, "tau": 0.01}),
    "fedyogi": ("FedYogi", {}),
    "fedyogi-tuned": ("FedYogi", {"eta": 0.1, "beta_1": 0.8, "beta_2": 0.95, "tau": 0.05}),
    "fedadagrad": ("FedAdagrad", {}),
    "fedadagrad-tuned": ("FedAdagrad", {"eta": 0.3, "tau": 0.02}),
}


def initial_model() -> dict[str, np.ndarray]:
    """Exactly representable float32 values from integer arithmetic (no RNG version drift)."""
    out = {}
    for j, (name, shape) in enumerate(SHAPES.items()):
        i = np.arange(int(np.prod(shape)))
        out[name] = (((i * 7 + 3 * j) % 13 - 6) / 8).astype(np.float32).reshape(shape)
    return out


def aggregate_for(server_round: int) -> dict[str, np.ndarray]:
    """The round's aggregate: fixed values, not derived from the current model."""
    out = {}
    for j, (name, shape) in enumerate(SHAPES.items()):
        i = np.arange(int(np.prod(shape)))
        raw = ((i * 5 + 3 * server_round + j) % 11 - 5) / 16 + (((i * 7 + 3 * j) % 13 - 6) / 8)
        out[name] = raw.astype(np.float32).reshape(shape)
    return out


def flower_rounds(case: str) -> list[dict[str, np.ndarray]]:
    """The new global model after each round, from Flower's own strategy (the serverapp API)."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp import strategy
    from flwr.supercore.task_identity import TaskIdentity

    class Grid:  # just enough of flwr's Grid for configure_train to sample two nodes
        def get_node_ids(self) -> list[int]:
            return [1, 2]

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    cls_name, hyper = CASES[case]
    st = getattr(strategy, cls_name)(**hyper)
    current = initial_model()
    outputs = []
    for r in range(1, ROUNDS + 1):
        record = ArrayRecord({k: Array(v) for k, v in current.items()})
        sent = list(st.configure_train(r, record, ConfigRecord(), Grid()))
        arrays = ArrayRecord({k: Array(v) for k, v in aggregate_for(r).items()})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
        new, _ = st.aggregate_train(r, [Message(content, reply_to=sent[0])])
        current = {k: np.asarray(a.numpy()) for k, a in new.items()}
        outputs.append(current)
    return outputs


# --- end of flower driver ---

# Recorded from flwr==1.42.0 by flower_rounds (float64 where Flower returned float64).
GOLDEN: dict[str, list[dict[str, list[float]]]] = {
    "fedavg": [
        {
            "layer.weight": [
                -0.875,
                0.3125,
                -0.8125,
                0.375,
                -0.75,
                0.4375,
                -0.6875,
                0.5,
                0.0625,
                0.5625,
                0.125,
                0.625,
            ],
            "layer.bias": [-0.4375, 0.75, -0.375, 0.8125, -0.3125],
        },
        {
            "layer.weight": [
                -0.6875,
                -0.1875,
                -0.625,
                0.5625,
                -0.5625,
                0.625,
                -0.5,
                0.6875,
                -0.4375,
                0.75,
                -0.375,
                0.8125,
            ],
            "layer.bias": [-0.25, 0.25, -0.1875, 0.3125, -0.125],
        },
        {
            "layer.weight": [
                -0.5,
                0.0,
                -0.4375,
                0.0625,
                -0.375,
                0.125,
                -0.3125,
                0.1875,
                -0.25,
                0.9375,
                -0.1875,
                1.0,
            ],
            "layer.bias": [-0.0625, 0.4375, 0.0, 0.5, 0.0625],
        },
    ],
    "fedavgm-defaults": [
        {
            "layer.weight": [
                -0.875,
                0.3125,
                -0.8125,
                0.375,
                -0.75,
                0.4375,
                -0.6875,
                0.5,
                0.0625,
                0.5625,
                0.125,
                0.625,
            ],
            "layer.bias": [-0.4375, 0.75, -0.375, 0.8125, -0.3125],
        },
        {
            "layer.weight": [
                -0.6875,
                -0.1875,
                -0.625,
                0.5625,
                -0.5625,
                0.625,
                -0.5,
                0.6875,
                -0.4375,
                0.75,
                -0.375,
                0.8125,
            ],
            "layer.bias": [-0.25, 0.25, -0.1875, 0.3125, -0.125],
        },
        {
            "layer.weight": [
                -0.5,
                0.0,
                -0.4375,
                0.0625,
                -0.375,
                0.125,
                -0.3125,
                0.1875,
                -0.25,
                0.9375,
                -0.1875,
                1.0,
            ],
            "layer.bias": [-0.0625, 0.4375, 0.0, 0.5, 0.0625],
        },
    ],
    "fedavgm-lr": [
        {
            "layer.weight": [
                -0.8125,
                0.21875,
                -0.71875,
                0.3125,
                -0.625,
                0.40625,
                -0.53125,
                0.5,
                -0.09375,
                0.59375,
                0.0,
                0.6875,
            ],
            "layer.bias": [-0.40625, 0.625, -0.3125, 0.71875, -0.21875],
        },
        {
            "layer.weight": [
                -0.75,
                0.015625,
                -0.671875,
                0.4375,
                -0.59375,
                0.515625,
                -0.515625,
                0.59375,
                -0.265625,
                0.671875,
                -0.1875,
                0.75,
            ],
            "layer.bias": [-0.328125, 0.4375, -0.25, 0.515625, -0.171875],
        },
        {
            "layer.weight": [
                -0.625,
                0.0078125,
                -0.5546875,
                0.25,
                -0.484375,
                0.3203125,
                -0.4140625,
                0.390625,
                -0.2578125,
                0.8046875,
                -0.1875,
                0.875,
            ],
            "layer.bias": [-0.1953125, 0.4375, -0.125, 0.5078125, -0.0546875],
        },
    ],
    "fedavgm-momentum": [
        {
            "layer.weight": [
                -0.8500000238418579,
                0.2750000059604645,
                -0.7749999761581421,
                0.3499999940395355,
                -0.699999988079071,
                0.42500001192092896,
                -0.625,
                0.5,
                0.0,
                0.574999988079071,
                0.07500000298023224,
                0.6499999761581421,
            ],
            "layer.bias": [
                -0.42500001192092896,
                0.699999988079071,
                -0.3499999940395355,
                0.7749999761581421,
                -0.2750000059604645,
            ],
        },
        {
            "layer.weight": [
                -0.8100000023841858,
                0.03999999165534973,
                -0.7899999618530273,
                0.6100000143051147,
                -0.7699999809265137,
                0.6299999952316284,
                -0.75,
                0.6499999761581421,
                -0.125,
                0.6700000166893005,
                -0.10499998927116394,
                0.6899999976158142,
            ],
            "layer.bias": [
                -0.32999998331069946,
                0.5199999809265137,
                -0.3100000023841858,
                0.5399999618530273,
                -0.28999999165534973,
            ],
        },
        {
            "layer.weight": [
                -0.5260000228881836,
                -0.20350000262260437,
                -0.5214999914169312,
                0.4059999883174896,
                -0.5169999599456787,
                0.4104999899864197,
                -0.512499988079071,
                0.41499996185302734,
                -0.3375000059604645,
                0.9695000052452087,
                -0.3330000042915344,
                0.9739999771118164,
            ],
            "layer.bias": [
                -0.03049999475479126,
                0.2919999957084656,
                -0.025999993085861206,
                0.296500027179718,
                -0.021499991416931152,
            ],
        },
    ],
    "fedadam": [
        {
            "layer.weight": [
                -0.8187462759452105,
                0.19548669497698323,
                -0.6954866949769832,
                0.31874627594521054,
                -0.5713903638604106,
                0.43900515285719405,
                -0.4469437817356301,
                0.5,
                -0.1780562182643699,
                0.5609948471428059,
                -0.053609636139589315,
                0.6812537240547895,
            ],
            "layer.bias": [
                -0.43900515285719405,
                0.5713903638604106,
                -0.31874627594521054,
                0.6954866949769832,
                -0.19548669497698323,
            ],
        },
        {
            "layer.weight": [
                -0.8124986193874888,
                0.1642392263720464,
                -0.7253243664093171,
                0.39861780704075456,
                -0.6244725471218687,
                0.5137463821834878,
                -0.5122728008918221,
                0.5603740648790179,
                -0.17471432488005878,
                0.6013945421410419,
                -0.06833044717515725,
                0.6875013806125112,
            ],
            "layer.bias": [
                -0.39860545785895796,
                0.5566695528248428,
                -0.3124986193874888,
                0.6642392263720464,
                -0.22532436640931705,
            ],
        },
        {
            "layer.weight": [
                -0.7611968342932074,
                0.11987744559344557,
                -0.6933192571450884,
                0.39659758618199253,
                -0.6156953891606115,
                0.4915998759399413,
                -0.5275484504708272,
                0.5327769093983404,
                -0.18236561966204026,
                0.6671243544903915,
                -0.09587227707659954,
                0.7388031657067926,
            ],
            "layer.bias": [
                -0.33287564550960835,
                0.5291277229234005,
                -0.2611968342932074,
                0.6198774455934455,
                -0.19331925714508838,
            ],
        },
    ],
    "fedadam-tuned": [
        {
            "layer.weight": [
                -0.7866699761813519,
                0.16431599543346065,
                -0.6643159954334606,
                0.2866699761813519,
                -0.5407875661536882,
                0.40550990378117974,
                -0.41672459717921323,
                0.5,
                -0.20827540282078677,
                0.5944900962188203,
                -0.08421243384631183,
                0.7133300238186481,
            ],
            "layer.bias": [
                -0.40550990378117974,
                0.5407875661536882,
                -0.2866699761813519,
                0.6643159954334606,
                -0.16431599543346065,
            ],
        },
        {
            "layer.weight": [
                -0.7774075571301341,
                0.1358129863390138,
                -0.6762914297633849,
                0.3346209238613284,
                -0.5663654791672469,
                0.45104784066543935,
                -0.44990269479710343,
                0.5402467068799941,
                -0.21672173212367082,
                0.6239999197218941,
                -0.10337780605204235,
                0.7225924428698659,
            ],
            "layer.bias": [
                -0.37600008027810605,
                0.5216221939479576,
                -0.2774075571301341,
                0.6358129863390138,
                -0.17629142976338488,
            ],
        },
        {
            "layer.weight": [
                -0.7350663020864855,
                0.10532005517067118,
                -0.644235522978142,
                0.322656721803803,
                -0.5485578592004722,
                0.42756239356649767,
                -0.44744165382248474,
                0.5102291091835001,
                -0.22559779125850782,
                0.672546378834498,
                -0.12416039707773102,
                0.7649336979135145,
            ],
            "layer.bias": [
                -0.32745362116550214,
                0.5008396029222689,
                -0.2350663020864855,
                0.6053200551706712,
                -0.14423552297814202,
            ],
        },
    ],
    "fedyogi": [
        {
            "layer.weight": [
                -0.7592592835426331,
                0.13449367880821228,
                -0.6344936490058899,
                0.25925925374031067,
                -0.5096153616905212,
                0.3836206793785095,
                -0.38468992710113525,
                0.5,
                -0.24031007289886475,
                0.6163793206214905,
                -0.11538461595773697,
                0.7407407164573669,
            ],
            "layer.bias": [
                -0.3836206793785095,
                0.5096153616905212,
                -0.25925925374031067,
                0.6344936490058899,
                -0.13449367880821228,
            ],
        },
        {
            "layer.weight": [
                -0.7619025111198425,
                0.13048842549324036,
                -0.6425670981407166,
                0.2715595066547394,
                -0.52008056640625,
                0.39509710669517517,
                -0.3962482213973999,
                0.5094936490058899,
                -0.23809513449668884,
                0.6212912797927856,
                -0.11631911247968674,
                0.7380974888801575,
            ],
            "layer.bias": [
                -0.37870872020721436,
                0.5086808800697327,
                -0.26190248131752014,
                0.630488395690918,
                -0.14256712794303894,
            ],
        },
        {
            "layer.weight": [
                -0.7546119689941406,
                0.12385772168636322,
                -0.6404212713241577,
                0.2756980061531067,
                -0.5235368013381958,
                0.39503803849220276,
                -0.4039762318134308,
                0.505488395690918,
                -0.23641452193260193,
                0.6320412158966064,
                -0.11903084069490433,
                0.7453880310058594,
            ],
            "layer.bias": [
                -0.36795878410339355,
                0.5059691667556763,
                -0.2546119689941406,
                0.6238576769828796,
                -0.1404212862253189,
            ],
        },
    ],
    "fedyogi-tuned": [
        {
            "layer.weight": [
                -0.7820714712142944,
                0.16579356789588928,
                -0.6657935380935669,
                0.2820715010166168,
                -0.547213613986969,
                0.3945387601852417,
                -0.42713671922683716,
                0.5,
                -0.19786328077316284,
                0.6054612398147583,
                -0.0777864009141922,
                0.7179285287857056,
            ],
            "layer.bias": [
                -0.3945387601852417,
                0.547213613986969,
                -0.2820715010166168,
                0.6657935380935669,
                -0.16579356789588928,
            ],
        },
        {
            "layer.weight": [
                -0.783348023891449,
                0.136633962392807,
                -0.6898155808448792,
                0.3461959660053253,
                -0.5879116058349609,
                0.44878965616226196,
                -0.4801732003688812,
                0.5407935380935669,
                -0.1963619738817215,
                0.6276503205299377,
                -0.09199439734220505,
                0.716651976108551,
            ],
            "layer.bias": [
                -0.37234967947006226,
                0.5330055952072144,
                -0.28334805369377136,
                0.6366339325904846,
                -0.18981558084487915,
            ],
        },
        {
            "layer.weight": [
                -0.7377614974975586,
                0.09521543979644775,
                -0.6622543931007385,
                0.3490740954875946,
                -0.5813152194023132,
                0.4345827102661133,
                -0.4940125048160553,
                0.5116339325904846,
                -0.20297060906887054,
                0.6880142688751221,
                -0.11684924364089966,
                0.7622385025024414,
            ],
            "layer.bias": [
                -0.3119857609272003,
                0.5081507563591003,
                -0.2377614974975586,
                0.5952154397964478,
                -0.16225439310073853,
            ],
        },
    ],
    "fedadagrad": [
        {
            "layer.weight": [
                -0.8492063283920288,
                0.22446949779987335,
                -0.7244694828987122,
                0.3492063581943512,
                -0.5996016263961792,
                0.4734252095222473,
                -0.47468101978302,
                0.5,
                -0.15031898021697998,
                0.5265747904777527,
                -0.02539840340614319,
                0.6507936716079712,
            ],
            "layer.bias": [
                -0.4734252095222473,
                0.5996016263961792,
                -0.3492063581943512,
                0.7244694828987122,
                -0.22446949779987335,
            ],
        },
        {
            "layer.weight": [
                -0.7704737186431885,
                0.13365356624126434,
                -0.6778251528739929,
                0.435134619474411,
                -0.5849795937538147,
                0.5653138756752014,
                -0.4827309548854828,
                0.5994694828987122,
                -0.21782487630844116,
                0.6224644780158997,
                -0.10655160993337631,
                0.7295262813568115,
            ],
            "layer.bias": [
                -0.37753552198410034,
                0.5184484124183655,
                -0.27047374844551086,
                0.6336535215377808,
                -0.17782513797283173,
            ],
        },
        {
            "layer.weight": [
                -0.6909257173538208,
                0.10539411008358002,
                -0.6031052470207214,
                0.35199183225631714,
                -0.5212692618370056,
                0.4717988669872284,
                -0.4351481795310974,
                0.5086535215377808,
                -0.2253665030002594,
                0.702780544757843,
                -0.12501826882362366,
                0.8090742826461792,
            ],
            "layer.bias": [
                -0.297219455242157,
                0.49998173117637634,
                -0.1909257471561432,
                0.6053940653800964,
                -0.10310522466897964,
            ],
        },
    ],
    "fedadagrad-tuned": [
        {
            "layer.weight": [
                -1.0086207389831543,
                0.39608436822891235,
                -0.8960843682289124,
                0.5086207389831543,
                -0.7777777910232544,
                0.6022727489471436,
                -0.6569548845291138,
                0.5,
                0.03195488452911377,
                0.39772725105285645,
                0.1527777910232544,
                0.4913792908191681,
            ],
            "layer.bias": [
                -0.6022727489471436,
                0.7777777910232544,
                -0.5086207389831543,
                0.8960843682289124,
                -0.39608436822891235,
            ],
        },
        {
            "layer.weight": [
                -0.7443903684616089,
                0.11948907375335693,
                -0.6634673476219177,
                0.6121567487716675,
                -0.5932096242904663,
                0.6810919642448425,
                -0.5295913815498352,
                0.7710843682289124,
                -0.2092224806547165,
                0.6774759292602539,
                -0.10936596989631653,
                0.7556096315383911,
            ],
            "layer.bias": [
                -0.3225240707397461,
                0.5156340599060059,
                -0.24439039826393127,
                0.6194890737533569,
                -0.16346736252307892,
            ],
        },
        {
            "layer.weight": [
                -0.578685998916626,
                0.06386993825435638,
                -0.5019198060035706,
                0.3308873474597931,
                -0.43567657470703125,
                0.3934852182865143,
                -0.3786959648132324,
                0.49448907375335693,
                -0.2301187962293625,
                0.8462191224098206,
                -0.1478431224822998,
                0.921314001083374,
            ],
            "layer.bias": [
                -0.15378089249134064,
                0.4771568775177002,
                -0.07868601381778717,
                0.5638699531555176,
                -0.0019198358058929443,
            ],
        },
    ],
}

KIND_OF_CASE = {case: ServerOptimizerKind(cls.lower()) for case, (cls, _) in CASES.items()}


def _our_rounds(case: str) -> list[dict[str, np.ndarray]]:
    opt = server_optimizer(KIND_OF_CASE[case], **CASES[case][1])
    current = initial_model()
    outputs = []
    for r in range(1, ROUNDS + 1):
        current = opt.step(current, aggregate_for(r), r)
        outputs.append(current)
    return outputs


def _assert_close(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> None:
    assert list(ours) == list(theirs)
    for name in ours:
        assert ours[name].dtype == np.float32
        got = ours[name].astype(np.float64).ravel()
        np.testing.assert_allclose(got, np.asarray(theirs[name]).ravel(), rtol=0, atol=1e-6)


def test_the_registry_covers_every_kind() -> None:
    assert set(SERVER_OPTIMIZERS) == set(ServerOptimizerKind)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_flower_recorded_outputs(case: str) -> None:
    for ours, theirs in zip(_our_rounds(case), GOLDEN[case], strict=True):
        _assert_close(ours, theirs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_flower_live(case: str) -> None:
    pytest.importorskip("flwr", minversion="1.42")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    for ours, theirs in zip(_our_rounds(case), flower_rounds(case), strict=True):
        _assert_close(ours, theirs)


def test_the_recorded_outputs_are_flowers() -> None:
    pytest.importorskip("flwr", minversion="1.42")
    logging.getLogger("flwr").setLevel(logging.WARNING)
    for case in CASES:
        for recorded, live in zip(GOLDEN[case], flower_rounds(case), strict=True):
            for name, values in recorded.items():
                assert values == live[name].astype(np.float64).ravel().tolist()


DEFAULTS = {
    ServerOptimizerKind.FEDAVGM: {"server_learning_rate": 1.0, "server_momentum": 0.0},
    ServerOptimizerKind.FEDADAM: {
        "eta": 0.1, "eta_l": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3,
    },
    ServerOptimizerKind.FEDYOGI: {
        "eta": 1e-2, "eta_l": 0.0316, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3,
    },
    ServerOptimizerKind.FEDADAGRAD: {"eta": 0.1, "eta_l": 0.1, "tau": 1e-3},
    ServerOptimizerKind.NESTEROV: {"lr": 0.7, "momentum": 0.9},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(DEFAULTS, key=lambda k: k.value))
def test_defaults(kind: ServerOptimizerKind) -> None:
    hyper = server_optimizer(kind).hyper
    assert {name: getattr(hyper, name) for name in DEFAULTS[kind]} == DEFAULTS[kind]


@pytest.mark.parametrize("kind", sorted(set(DEFAULTS) - {ServerOptimizerKind.NESTEROV}, key=str))
def test_defaults_are_flowers_current_api(kind: ServerOptimizerKind) -> None:
    pytest.importorskip("flwr", minversion="1.42")
    from flwr.serverapp import strategy

    cls = {v: k for k, v in {c: KIND_OF_CASE[c] for c in CASES}.items()}[kind]
    params = inspect.signature(getattr(strategy, CASES[cls][0]).__init__).parameters
    assert {name: params[name].default for name in DEFAULTS[kind]} == DEFAULTS[kind]


def _torch_nesterov(lr: float, momentum: float, rounds: int) -> list[dict[str, np.ndarray]]:
    torch = pytest.importorskip("torch")
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in initial_model().items()}
    sgd = torch.optim.SGD(params.values(), lr=lr, momentum=momentum, nesterov=True)
    outputs = []
    for r in range(1, rounds + 1):
        for name, p in params.items():  # the pseudo-gradient: current - aggregate
            p.grad = p.detach() - torch.from_numpy(aggregate_for(r)[name])
        sgd.step()
        outputs.append({k: p.detach().numpy().copy() for k, p in params.items()})
    return outputs


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.5), (0.1, 0.99)])
def test_nesterov_matches_torch_sgd(lr: float, momentum: float) -> None:
    opt = server_optimizer("nesterov", lr=lr, momentum=momentum)
    current = initial_model()
    for r, theirs in enumerate(_torch_nesterov(lr, momentum, 5), start=1):
        current = opt.step(current, aggregate_for(r), r)
        _assert_close(current, theirs)
    assert sorted(opt.state) == ["momentum/layer.bias", "momentum/layer.weight"]


def test_nesterov_without_momentum_is_sgd_on_the_pseudo_gradient() -> None:
    opt = server_optimizer("nesterov", lr=0.5, momentum=0.0)
    cur, agg = initial_model(), aggregate_for(1)
    out = opt.step(cur, agg, 1)
    for name in cur:
        np.testing.assert_array_equal(
            out[name], cur[name] - np.float32(0.5) * (cur[name] - agg[name])
        )
    assert opt.state == {}


STATE_NAMES = {
    "fedavg": [],
    "fedavgm-defaults": [],
    "fedavgm-lr": [],
    "fedavgm-momentum": ["momentum/layer.bias", "momentum/layer.weight"],
    "fedadam": ["m/layer.bias", "m/layer.weight", "v/layer.bias", "v/layer.weight"],
    "fedyogi": ["m/layer.bias", "m/layer.weight", "v/layer.bias", "v/layer.weight"],
    "fedadagrad": ["v/layer.bias", "v/layer.weight"],
}


@pytest.mark.parametrize("case", sorted(STATE_NAMES))
def test_state_names(case: str) -> None:
    opt = server_optimizer(KIND_OF_CASE[case], **CASES[case][1])
    assert opt.state == {}
    opt.step(initial_model(), aggregate_for(1), 1)
    assert sorted(opt.state) == STATE_NAMES[case]
    for arr in opt.state.values():
        assert arr.dtype == np.float32 and not arr.flags.writeable


@pytest.mark.parametrize("case", [*sorted(CASES), "nesterov"])
def test_resume_from_saved_state_is_bit_identical(case: str) -> None:
    kind = KIND_OF_CASE.get(case, ServerOptimizerKind.NESTEROV)
    hyper = CASES[case][1] if case in CASES else {}
    straight = server_optimizer(kind, **hyper)
    current = initial_model()
    for r in range(1, 6):
        current = straight.step(current, aggregate_for(r), r)

    first = server_optimizer(kind, **hyper)
    resumed_from = first.step(initial_model(), aggregate_for(1), 1)
    first.step(resumed_from, aggregate_for(2), 2)
    saved = {k: np.array(v) for k, v in first.state.items()}  # as if stored as blocks
    model = first.step(resumed_from, aggregate_for(2), 2)  # recomputed below, after a kill
    del first, model
    restarted = server_optimizer(kind, **hyper)
    restarted.load_state(saved)
    again = server_optimizer(kind, **hyper)  # the straight run up to round 2
    current2 = again.step(again.step(initial_model(), aggregate_for(1), 1), aggregate_for(2), 2)
    for r in range(3, 6):
        current2 = restarted.step(current2, aggregate_for(r), r)
    for name in current:
        assert current[name].tobytes() == current2[name].tobytes()
    assert {k: v.tobytes() for k, v in restarted.state.items()} == {
        k: v.tobytes() for k, v in straight.state.items()
    }


def test_the_step_never_aliases_or_changes_its_inputs() -> None:
    cur, agg = initial_model(), aggregate_for(1)
    before = {k: v.copy() for k, v in cur.items()}
    for kind in ServerOptimizerKind:
        out = server_optimizer(kind).step(cur, agg, 1)
        for name in cur:
            assert not np.shares_memory(out[name], cur[name])
            assert not np.shares_memory(out[name], agg[name])
            np.testing.assert_array_equal(cur[name], before[name])


def test_chunked_kernel_matches_the_whole_array_formula() -> None:
    n = 2 * kernels.CHUNK + 3  # three chunks, the last one short
    rng = np.random.default_rng(1)
    cur = {"x": rng.standard_normal(n, dtype=np.float32)}
    aggs = [{"x": cur["x"] + rng.standard_normal(n, dtype=np.float32) / 10} for _ in range(3)]
    opt = server_optimizer("fedadam")
    x = cur["x"].astype(np.float64)
    m = np.zeros(n)
    v = np.zeros(n)
    out = cur
    for r, agg in enumerate(aggs, start=1):
        out = opt.step(out, agg, r)
        d = agg["x"].astype(np.float64) - x
        m = 0.9 * m + 0.1 * d
        v = 0.99 * v + 0.01 * d * d
        x = x + 0.1 * np.sqrt(1 - 0.99 ** (r + 1)) / (1 - 0.9 ** (r + 1)) * m / (np.sqrt(v) + 1e-3)
        np.testing.assert_allclose(out["x"], x, rtol=0, atol=1e-5)


def test_float64_tensors_are_computed_in_float64_and_bfloat16_in_float32() -> None:
    import ml_dtypes

    cur = {"a": np.ones(4, np.float64), "b": np.ones(4, ml_dtypes.bfloat16)}
    agg = {"a": np.full(4, 1.5), "b": np.full(4, 1.5, ml_dtypes.bfloat16)}
    opt = server_optimizer("fedadam")
    out = opt.step(cur, agg, 1)
    assert out["a"].dtype == np.float64 and out["b"].dtype == np.float32
    assert opt.state["m/a"].dtype == np.float64 and opt.state["v/b"].dtype == np.float32


def test_torch_tensors_are_accepted() -> None:
    torch = pytest.importorskip("torch")
    cur, agg = initial_model(), aggregate_for(1)
    want = server_optimizer("fedadam").step(cur, agg, 1)
    got = server_optimizer("fedadam").step({k: torch.from_numpy(v) for k, v in cur.items()}, agg, 1)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


# ── validation ───────────────────────────────────────────────────────────────
def test_the_errors_are_public_aggregation_errors() -> None:
    for cls in (
        InvalidServerOptimizer,
        InvalidServerRound,
        InvalidServerStepInput,
        ServerOptimizerStateMismatch,
    ):
        assert issubclass(cls, AggregationError) and issubclass(cls, ValueError)
        assert getattr(tensorswap.errors, cls.__name__) is cls  # the whole tree is there


def test_unknown_kind_and_option() -> None:
    with pytest.raises(InvalidServerOptimizer, match="unknown kind") as info:
        server_optimizer("sgd")
    assert info.value.option == "kind"
    with pytest.raises(InvalidServerOptimizer, match="not a fedadam option") as info:
        server_optimizer("fedadam", lr=0.1)
    assert info.value.option == "lr"
    assert server_optimizer("FedAdam").kind is ServerOptimizerKind.FEDADAM


RANGES = {  # option -> (kinds it belongs to, how it is bounded)
    "eta": (["fedadam", "fedyogi", "fedadagrad"], "positive"),
    "eta_l": (["fedadam", "fedyogi", "fedadagrad"], "positive"),
    "tau": (["fedadam", "fedyogi", "fedadagrad"], "positive"),
    "beta_1": (["fedadam", "fedyogi"], "unit"),
    "beta_2": (["fedadam", "fedyogi"], "unit"),
    "server_learning_rate": (["fedavgm"], "positive"),
    "server_momentum": (["fedavgm"], "unit"),
    "lr": (["nesterov"], "positive"),
    "momentum": (["nesterov"], "unit"),
}


def _valid(bound: str, x: float) -> bool:
    return x > 0 if bound == "positive" else 0 <= x < 1


@given(
    option=st.sampled_from(sorted(RANGES)),
    value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3)),
    pick=st.integers(0, 2),
)
def test_hyper_parameter_ranges(option: str, value: float, pick: int) -> None:
    kinds, bound = RANGES[option]
    kind = kinds[pick % len(kinds)]
    if np.isfinite(value) and _valid(bound, float(value)):
        assert getattr(server_optimizer(kind, **{option: value}).hyper, option) == value
    else:
        with pytest.raises(InvalidServerOptimizer) as info:
            server_optimizer(kind, **{option: value})
        assert info.value.option == option and info.value.value is value


@pytest.mark.parametrize("value", [True, "0.1", None, [0.1]])
def test_hyper_parameters_must_be_real_numbers(value: object) -> None:
    with pytest.raises(InvalidServerOptimizer, match="real number"):
        server_optimizer("fedadam", eta=value)


@pytest.mark.parametrize("server_round", [0, -1, True, 1.0, "1", None])
def test_server_round_must_be_a_positive_int(server_round: object) -> None:
    opt = server_optimizer("fedadam")
    with pytest.raises(InvalidServerRound):
        opt.step(initial_model(), aggregate_for(1), server_round)  # type: ignore[arg-type]
    assert opt.state == {}


def _bad_inputs() -> list[tuple[str, object, object]]:
    cur, agg = initial_model(), aggregate_for(1)
    short = {"layer.weight": agg["layer.weight"]}
    reshaped = {**agg, "layer.bias": agg["layer.bias"][:4]}
    ints = {**agg, "layer.bias": agg["layer.bias"].astype(np.int32)}
    listed = {**agg, "layer.bias": agg["layer.bias"].tolist()}
    return [
        ("names differ", cur, short),
        ("shapes differ", cur, reshaped),
        ("dtype int32", cur, ints),
        ("not a numpy array", cur, listed),
        ("must map names", list(cur.values()), agg),
    ]


@pytest.mark.parametrize(("match", "cur", "agg"), _bad_inputs(), ids=lambda x: str(x)[:12])
def test_mismatched_inputs_raise_before_any_state_changes(
    match: str, cur: object, agg: object
) -> None:
    opt = server_optimizer("fedadam")
    opt.step(initial_model(), aggregate_for(1), 1)
    before = {k: v.copy() for k, v in opt.state.items()}
    with pytest.raises(InvalidServerStepInput, match=match):
        opt.step(cur, agg, 2)  # type: ignore[arg-type]
    assert {k: v.tobytes() for k, v in opt.state.items()} == {
        k: v.tobytes() for k, v in before.items()
    }


def test_load_state_checks_names_dtypes_and_completeness() -> None:
    opt = server_optimizer("fedadam")
    good = np.zeros(5, np.float32)
    with pytest.raises(ServerOptimizerStateMismatch, match="keeps m/<tensor>, v/<tensor>"):
        opt.load_state({"momentum/layer.bias": good})
    with pytest.raises(ServerOptimizerStateMismatch, match="missing"):
        opt.load_state({"m/layer.bias": good})
    with pytest.raises(ServerOptimizerStateMismatch, match="float32/float64"):
        opt.load_state({"m/layer.bias": good.astype(np.int32), "v/layer.bias": good})
    with pytest.raises(ServerOptimizerStateMismatch, match="no state"):
        server_optimizer("fedavg").load_state({"m/x": good})
    assert opt.state == {}


def test_a_loaded_state_for_another_model_is_refused_at_the_step() -> None:
    opt = server_optimizer("fedadam")
    opt.load_state({"m/other": np.zeros(5, np.float32), "v/other": np.zeros(5, np.float32)})
    with pytest.raises(ServerOptimizerStateMismatch, match="other tensors"):
        opt.step(initial_model(), aggregate_for(1), 1)
    wrong_shape = {f"{p}/{k}": np.zeros(3, np.float32) for p in "mv" for k in SHAPES}
    opt.load_state(wrong_shape)
    with pytest.raises(ServerOptimizerStateMismatch, match="the step needs float32"):
        opt.step(initial_model(), aggregate_for(1), 1)
    assert sorted(opt.state) == sorted(wrong_shape)  # unchanged


def test_load_state_copies_and_an_empty_state_resets() -> None:
    opt = server_optimizer("fedadam")
    opt.step(initial_model(), aggregate_for(1), 1)
    saved = {k: np.array(v) for k, v in opt.state.items()}
    fresh = server_optimizer("fedadam")
    fresh.load_state(saved)
    fresh.step(initial_model(), aggregate_for(2), 2)
    assert all(np.array_equal(saved[k], v) for k, v in opt.state.items())  # saved untouched
    fresh.load_state({})
    assert fresh.state == {}


@pytest.mark.parametrize("kind", list(ServerOptimizerKind))
def test_a_step_split_over_threads_is_bit_identical(kind: ServerOptimizerKind) -> None:
    rng = np.random.default_rng(2)
    sizes = {"big": 2 * kernels.PIECE + 5, "small": 7}  # several pieces, one short
    cur = {k: rng.standard_normal(n, dtype=np.float32) for k, n in sizes.items()}
    agg = {k: v + rng.standard_normal(v.size, dtype=np.float32) / 10 for k, v in cur.items()}
    hyper = {"server_momentum": 0.9} if kind is ServerOptimizerKind.FEDAVGM else {}
    one, three = (server_optimizer(kind, workers=w, **hyper) for w in (1, 3))
    for r in (1, 2):
        a, b = one.step(cur, agg, r), three.step(cur, agg, r)
        assert {k: v.tobytes() for k, v in a.items()} == {k: v.tobytes() for k, v in b.items()}
    assert {k: v.tobytes() for k, v in one.state.items()} == {
        k: v.tobytes() for k, v in three.state.items()
    }


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, None])
def test_workers_must_be_a_positive_int(workers: object) -> None:
    with pytest.raises(InvalidServerOptimizer, match="workers"):
        server_optimizer("fedadam", workers=workers)  # type: ignore[arg-type]
