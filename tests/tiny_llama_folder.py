"""Shared test helper: a tiny random Llama saved like any hub model folder, with a byte-level BPE
tokenizer trained on the spot (needs torch, transformers and tokenizers), and the shape every tiny
random model of the tests has."""

# The tiny decoder the model tests build: 4 query heads over 2 KV heads, head_dim 16 at hidden size 64.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def save_tiny_llama(folder, text: str, *, vocab_size: int, layers: int, seed: int):
    """Save a Llama of `layers` layers (4 query heads, 2 KV heads, head_dim 16) and a tokenizer of
    `vocab_size` tokens trained on `text` into `folder`; returns `folder`. Its q/k weights are scaled
    up 8 times: peaked attention, so a wrong row would show."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [text] * 3,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(folder)
    cfg = LlamaConfig(
        **TINY_SHAPE,
        vocab_size=len(tok),
        num_hidden_layers=layers,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(folder)
    return folder
