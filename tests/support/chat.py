"""Chat templates rendered as transformers renders them: a Llama-3-shaped and a Qwen-shaped
template (REFUSING: Qwen's, refusing a tool turn), their special tokens, and multi-turn
conversations with a system prompt, non-ASCII text and metadata."""


LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}"
          "<|eot_id|>{% endgeneration %}{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
        "assistant.<|im_end|>\n{% endif %}{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
        "{{ message['content'] }}<|im_end|>{% endgeneration %}\n"
        "{% else %}<|im_start|>{{ message['role'] }}\n"
        "{% if message.meta is defined %}{{ message.meta | tojson }}\n{% endif %}"
        "{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>"]
TOKENS = {"llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
          "qwen": {"eos_token": "<|im_end|>"}}
TEMPLATES = {"llama3": LLAMA3, "qwen": QWEN}
CONVERSATIONS = [
    [{"role": "user", "content": "What is a list in Python?"},
     {"role": "assistant", "content": "An ordered, mutable sequence: [1, 2, 3]."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name a prime.", "meta": {"lang": "en", "note": "café"}},
     {"role": "assistant", "content": " Seven. "},
     {"role": "user", "content": "And an even one?"},
     {"role": "assistant", "content": "Two, the only even prime — naïvely the smallest."}],
]
REFUSING = QWEN + "{% if messages[-1]['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
