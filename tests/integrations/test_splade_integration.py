"""The fused SPLADE head inside the real libraries: sentence-transformers' SparseEncoder (masked-LM Transformer +
SpladePooling, patched) and a plain transformers masked LM (splade_encode), on tiny randomly initialised models.

Nothing is downloaded: the BERT/DistilBERT models are built from their configurations and a WordPiece vocabulary
written to a temporary directory, which sentence-transformers loads like a hub checkpoint. The patched model must
reproduce the unpatched model's encodings and a training step's gradients: both are compared normwise with the
float64 unpatched model, allowing twice the float32 unpatched model's own error (a deep pipeline, where elementwise
errors of two equally good computations are uncorrelated).
"""

import copy
import io

import pytest
import torch

from sparsefuse import track_launches
from sparsefuse.integrations import sentence_transformers as sf_st
from sparsefuse.integrations.transformers_mlm import SpladeEncoderForMaskedLM, splade_encode
from sparsefuse.testing import assert_norm_close_to_reference

transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")

WORDS = [f"w{i}" for i in range(40)] + list("abcdefghijklmnopqrstuvwxyz")
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS  # 71 tokens: not a multiple of any tile
QUERIES = ["w1 w2 a", "w3 b c w4 w5", "w7", "w8 w9 w10 d e f g"]
DOCUMENTS = ["w1 w2 w11 h i j k l w12", "w3 m n", "w7 w13 o p q r s t u v w x", "w8 y z w14"]


def tiny_bert_config(**overrides):
    config = dict(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config.update(overrides)
    return transformers.BertConfig(**config)


def randomize_decoder_bias(mlm) -> None:
    """BERT initialises the decoder bias to zeros; a trained SPLADE model's is not, and the test's should not be."""
    with torch.no_grad():
        mlm.get_output_embeddings().bias.normal_(-0.5, 1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny BertForMaskedLM + WordPiece tokenizer saved like a hub checkpoint."""
    path = tmp_path_factory.mktemp("tiny-bert-mlm")
    (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    torch.manual_seed(0)
    mlm = transformers.BertForMaskedLM(tiny_bert_config())
    randomize_decoder_bias(mlm)
    mlm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def sparse_encoder(checkpoint, pooling, legacy_module):
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    transformer = MLMTransformer(checkpoint) if legacy_module else Transformer(checkpoint, transformer_task="fill-mask")
    return SparseEncoder(modules=[transformer, SpladePooling(pooling_strategy=pooling)], device="cpu")


def embed(model, texts, device):
    features = model.preprocess(texts)
    features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
    return model(features)["sentence_embedding"]


@pytest.mark.parametrize("pooling, legacy_module", [("max", True), ("max", False), ("sum", False)])
def test_sparse_encoder_encodings_match_unpatched(checkpoint, pooling, legacy_module, device):
    model = sparse_encoder(checkpoint, pooling, legacy_module).to(device).eval()
    patched = sf_st.patch(copy.deepcopy(model))
    assert type(patched[1]).__name__ == "SpladePooling"  # classes kept: model.save writes the same modules.json
    assert list(patched.state_dict()) == list(model.state_dict())
    texts = QUERIES + DOCUMENTS
    with torch.no_grad(), track_launches() as launched:
        ours = embed(patched, texts, device)
        reference = embed(copy.deepcopy(model).double(), texts, device)
        plain = embed(model, texts, device)
    assert launched["splade_fwd_kernel"] == 1
    assert ours.shape == plain.shape == (len(texts), len(VOCAB))
    assert torch.equal(ours == 0, plain == 0) or pooling == "sum"  # same sparsity pattern (max: ties at zero)
    assert_norm_close_to_reference(ours, reference, plain, name="sentence_embedding")
    # the public encode path (sparse COO output by default) goes through the patched modules too
    encoded = patched.encode(texts, convert_to_tensor=True)
    dense = encoded.to_dense() if encoded.is_sparse else encoded
    assert_norm_close_to_reference(dense.to(device), reference, plain, name="encode")


@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_sparse_encoder_training_step_gradients_match_unpatched(checkpoint, pooling, device):
    """One SpladeLoss step (in-batch negatives ranking + FLOPS regularisers), every parameter's gradient.

    The loss's gradient at the embeddings is taken from the float64 model and pushed back through each model: the
    ranking loss's softmax amplifies last-bit differences of the forward into the gradient of every parameter
    alike, so comparing whole steps would compare two roundings of the forward (tested above), not the backward."""
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    model = sparse_encoder(checkpoint, pooling, legacy_module=False).to(device).train()
    models = {"patched": sf_st.patch(copy.deepcopy(model)), "float64": copy.deepcopy(model).double(), "plain": model}
    embeddings = {}
    for name, m in models.items():
        m.zero_grad()
        with track_launches() as launched:
            embeddings[name] = [embed(m, texts, device) for texts in (QUERIES, DOCUMENTS)]
        if name == "patched":
            assert launched["splade_fwd_kernel"] == 2
    loss_model = models["float64"]
    loss_fn = SpladeLoss(
        loss_model,
        SparseMultipleNegativesRankingLoss(loss_model),
        document_regularizer_weight=3e-3,
        query_regularizer_weight=5e-5,
    )
    leaves = [e.detach().requires_grad_() for e in embeddings["float64"]]
    # SpladeLoss.forward's composition, on given embeddings
    document_flops = loss_fn.document_regularizer.compute_loss_from_embeddings(leaves[1])
    query_flops = loss_fn.query_regularizer.compute_loss_from_embeddings(leaves[0])
    total = (
        loss_fn.loss.compute_loss_from_embeddings(leaves, None)
        + loss_fn.document_regularizer_weight * document_flops
        + loss_fn.query_regularizer_weight * query_flops
    )
    grad_embeddings = torch.autograd.grad(total, leaves)
    grads = {}
    for name, m in models.items():
        with track_launches() as launched:
            torch.autograd.backward(embeddings[name], [g.to(embeddings[name][0].dtype) for g in grad_embeddings])
        if name == "patched":
            kernel = "gather_accumulate_kernel" if pooling == "max" else "splade_sum_bwd_hidden_kernel"
            assert launched[kernel] >= 2
        grads[name] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert grads["patched"].keys() == grads["plain"].keys()
    assert "0.model.bert.embeddings.word_embeddings.weight" in grads["patched"]  # tied with the projection
    assert "0.model.cls.predictions.bias" in grads["patched"]
    for n in grads["plain"]:
        assert_norm_close_to_reference(grads["patched"][n], grads["float64"][n], grads["plain"][n], name=n)


def test_patch_unpatch_and_errors(checkpoint, device):
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    model = sparse_encoder(checkpoint, "max", legacy_module=False).to(device).eval()
    mlm = model[0].auto_model
    sf_st.patch(model)
    assert sf_st.is_patched(model[1])
    assert sf_st.patch(model) is model and sf_st.is_patched(model)  # patching twice is a no-op
    features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model.preprocess(QUERIES).items()}
    with torch.no_grad():
        hidden = model[0](dict(features))["token_embeddings"]
        assert hidden.shape[-1] == 32  # the transformer now hands over hidden states, not logits
        sf_st.unpatch(model)
        assert not sf_st.is_patched(model[1]) and not sf_st.is_patched(model)
        logits = model[0](dict(features))["token_embeddings"]
        assert logits.shape[-1] == len(VOCAB)
        torch.testing.assert_close(logits, mlm(**{k: features[k] for k in ("input_ids", "attention_mask")}).logits)
    with pytest.raises(ValueError, match="log1p_relu"):
        from sentence_transformers import SparseEncoder

        sf_st.patch(SparseEncoder(modules=[model[0], SpladePooling(activation_function="log1p_relu")], device="cpu"))
    with pytest.raises(ValueError, match="no masked-LM transformer followed by SpladePooling"):
        sf_st.patch(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def torch_save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_patched_sparse_encoder_pickles_deep_copies_and_saves(checkpoint, device, tmp_path):
    """torch.save/torch.load and copy.deepcopy give a patched model bound to its own masked LM; sentence-transformers'
    own save/load gives the unpatched model (the patch lives in the Python objects, not in the saved files)."""
    from sentence_transformers import SparseEncoder

    plain = sparse_encoder(checkpoint, "max", legacy_module=False).to(device).eval()
    model = sf_st.patch(copy.deepcopy(plain))
    assert sf_st.is_patched(model) and not sf_st.is_patched(plain)
    with torch.no_grad():
        expected, unpatched = embed(model, QUERIES, device), embed(plain, QUERIES, device)
    features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in model.preprocess(QUERIES).items()}
    for copied in (torch_save_load(model), copy.deepcopy(model)):
        assert sf_st.is_patched(copied) and sf_st.is_patched(copied[1])
        with torch.no_grad(), track_launches() as launched:
            torch.testing.assert_close(embed(copied, QUERIES, device), expected, rtol=0, atol=0)
        assert launched["splade_fwd_kernel"] == 1
        sf_st.unpatch(copied)  # restores the copy's projection, not the original's
        with torch.no_grad():
            assert copied[0](dict(features))["token_embeddings"].shape[-1] == len(VOCAB)
            assert model[0](dict(features))["token_embeddings"].shape[-1] == 32
    model.save(str(tmp_path / "saved"))
    reloaded = SparseEncoder(str(tmp_path / "saved"), device=str(device))
    assert not sf_st.is_patched(reloaded)
    with torch.no_grad():
        torch.testing.assert_close(embed(reloaded.eval(), QUERIES, device), unpatched)
        torch.testing.assert_close(embed(sf_st.patch(reloaded), QUERIES, device), expected)


def test_patched_pooling_falls_back_when_the_projection_was_replaced(checkpoint, device):
    model = sparse_encoder(checkpoint, "max", legacy_module=False).to(device).eval()
    reference = copy.deepcopy(model)
    sf_st.patch(model)
    model[0].auto_model.resize_token_embeddings(len(VOCAB))  # builds a new output projection: patch bypassed
    with torch.no_grad():
        torch.testing.assert_close(embed(model, QUERIES, device), embed(reference, QUERIES, device))


# ----------------------------------------------------------------------------------------------------------------
# Plain transformers masked LMs
# ----------------------------------------------------------------------------------------------------------------


def naver_splade(model, input_ids, attention_mask, pooling="max"):
    """naver/splade's SPLADE head on the model's logits."""
    scores = torch.log1p(torch.relu(model(input_ids=input_ids, attention_mask=attention_mask).logits))
    scores = scores * attention_mask.unsqueeze(-1)
    return scores.sum(1) if pooling == "sum" else torch.max(scores, dim=1).values


def masked_lms():
    torch.manual_seed(1)
    bert = transformers.BertForMaskedLM(tiny_bert_config())
    distil = transformers.DistilBertForMaskedLM(
        transformers.DistilBertConfig(
            vocab_size=len(VOCAB),
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )
    for mlm in (bert, distil):
        randomize_decoder_bias(mlm)
    return {"bert": bert, "distilbert": distil}


@pytest.mark.parametrize("arch", ["bert", "distilbert"])
@pytest.mark.parametrize("pooling", ["max", "sum"])
def test_transformers_masked_lm_encode_and_gradients(arch, pooling, device):
    model = masked_lms()[arch].to(device).train()
    input_ids = torch.randint(5, len(VOCAB), (3, 11), device=device)
    attention_mask = torch.ones(3, 11, dtype=torch.int64, device=device)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    encoder = SpladeEncoderForMaskedLM(model, pooling=pooling)
    with track_launches() as launched:
        ours = encoder(input_ids, attention_mask)
    assert launched["splade_fwd_kernel"] == 1
    model64 = copy.deepcopy(model).double()
    reference = naver_splade(model64, input_ids, attention_mask, pooling)
    plain = naver_splade(model, input_ids, attention_mask, pooling)
    assert_norm_close_to_reference(ours, reference, plain)
    # the model's own forward is untouched after the call
    assert model(input_ids=input_ids, attention_mask=attention_mask).logits.shape[-1] == len(VOCAB)
    grads = {}
    for name, m, fn in [
        ("ours", model, lambda m: splade_encode(m, input_ids, attention_mask, pooling=pooling)),
        ("float64", model64, lambda m: naver_splade(m, input_ids, attention_mask, pooling)),
        ("plain", model, lambda m: naver_splade(m, input_ids, attention_mask, pooling)),
    ]:
        m.zero_grad()
        reps = fn(m)
        (reps.sum(1).pow(2).mean() + (reps.mean(0) ** 2).sum()).backward()  # a ranking-like + FLOPS-like loss
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert grads["ours"].keys() == grads["plain"].keys()
    for n in grads["plain"]:
        assert_norm_close_to_reference(grads["ours"][n], grads["float64"][n], grads["plain"][n], name=n)


def test_transformers_helper_rejects_models_without_a_projection():
    with pytest.raises(TypeError, match="no nn.Linear-like output projection"):
        SpladeEncoderForMaskedLM(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="pooling must be one of"):
        SpladeEncoderForMaskedLM(masked_lms()["bert"], pooling="mean")
