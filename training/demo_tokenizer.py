"""Train the demo's byte-level BPE from a small embedded English corpus and write it as a file.

    python -m training.demo_tokenizer [--out hybridkv_cli/models/weights/demo_tokenizer.json]

The shipped demo reads its vocabulary and merges from that file
(:func:`hybridkv_cli.models.demo.build_demo_tokenizer`), so the weights never depend on training the
tokenizer again; training here is deterministic, and a test checks that the file is what it gives.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

from hybridkv_cli.models.demo import DEMO_TOKENIZER, ENDOFTEXT

DEMO_BPE_VOCAB = 1900

# Qwen2's pre-tokenisation regex (the same one transformers' Qwen2Tokenizer uses).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS_TEXT = """\
You are a helpful assistant. Answer the question about the video or the images. Describe what
happens in the video. What is the man holding in his right hand? Which image shows a dog? How many
people are in the room? What color is the car that drives past the house? Where does the woman go
after she leaves the kitchen? Why does the child start to laugh? When does the light turn green?
The video shows a person walking along a river at sunset. A small dog runs after a red ball and
brings it back to the boy. Two men are playing chess in a quiet park while birds sit on the bench.
A woman opens the door, takes off her coat, and sits down at the table to read a letter. The camera
moves slowly from the left to the right and then zooms in on the face of an old man who is smiling.
In the first image there is a cat sleeping on a blue sofa; in the second image a bicycle leans
against a wall; in the third image three children are building a sand castle on the beach.
The answer is yes. The answer is no. The answer is A. The answer is B. The answer is C. The answer
is D. There are two cars, four trees, one house and seven birds in the picture. The scene takes
place at night in a busy city street with bright lights, tall buildings and many people. First the
chef cuts the onions, then he heats the oil in a pan, adds the vegetables and stirs them for five
minutes before he serves the food on a white plate. The weather is cold and it is raining. The
train arrives at the station, the doors open and the passengers get off with their bags.
Please watch the whole clip carefully before you answer. Look at each frame and find the moment
when the ball hits the window. The key is hidden under the green box next to the lamp. The number
written on the board is 42981. The sign says "Closed on Sunday". The video is about cooking, sports,
travel, music, animals, science, history, and everyday life. Summarize the main events in order.
Is the statement true or false? Choose the best option from the list below and answer with the
letter only. Options: (A) a kitchen (B) a garden (C) an office (D) a classroom. The speaker explains
how the machine works, points at the screen, and asks the audience a question. At the end of the
video everyone claps and the music stops. It was a sunny morning; the market was full of fruit,
bread, fish, cheese, flowers and noisy sellers. She wrote 3 words, 15 numbers, and 1,024 lines.
"""

_SUBJECTS = (
    "the man", "the woman", "a child", "the dog", "a cat", "the player", "the driver", "the teacher",
    "a bird", "the camera", "the robot", "my friend", "our team", "the girl", "the boy", "a horse",
)
_VERBS = (
    "walks", "runs", "jumps", "looks", "points", "waits", "sits", "stands", "drives", "turns",
    "opens", "closes", "throws", "catches", "pushes", "pulls", "reads", "writes", "sings", "dances",
)
_PLACES = (
    "in the kitchen", "near the window", "on the street", "at the station", "in the garden",
    "behind the door", "under the table", "across the bridge", "on the beach", "in the office",
    "at the market", "inside the car", "on the stage", "in the forest", "by the river", "on the roof",
)
_TIMES = ("at first", "then", "after that", "finally", "suddenly", "later", "again", "slowly")
_COLORS = ("red", "blue", "green", "yellow", "black", "white", "orange", "purple", "brown", "gray")
_THINGS = ("ball", "box", "hat", "bag", "book", "cup", "phone", "chair", "lamp", "key", "door", "car")
# Common English words, so that the trained vocabulary reaches ~1.5k entries.
_WORDS = """
about above across action actually add address after afternoon again against age ago agree air all
allow almost alone along already also always among amount and angle animal another answer any
anyone anything appear apple area arm around arrive art article ask attack attention audience
autumn away baby back bad bake balance band bank base basket bath bear beautiful because become
bed before begin behind believe bell below belt bench best better between big bike bill bit bitter
blanket block blood board boat body bone border bottle bottom bowl brain branch brave bread break
breakfast bridge bright bring broad brother brush build burn bus business busy butter button buy
cake call calm camp candle capital captain card care careful carry case castle catch cause ceiling
center certain chain chalk chance change chapter cheap check cheese chicken chief choice choose
church circle city class clean clear climb clock cloth cloud coast coat coffee coin cold collect
college comb come comfort common company compare complete computer condition contain control cook
cool copy corner correct cost cotton count country course cousin cover cow crack crowd cry cup
curtain cut daily damage danger dark date daughter day dead deal dear decide deep degree describe
desert design desk detail develop dictionary different difficult dinner direction dirty discover
dish distance divide doctor dollar double down draw dream dress drink drop dry duck during dust
each ear early earth east easy eat edge egg eight either electric elephant else empty end enemy
energy engine enjoy enough enter equal error evening event every exact example except excite
exercise expect experience explain eye face fact factory fail fair fall false family famous far farm
fast fat father fear feather feel fence few field fight figure fill film find fine finger finish
fire first fish fit five flag flat floor flower fly fold follow food foot force foreign forget fork
form forward four free fresh friend front fruit full fun funny future game garden gate gather
general gentle get gift give glad glass glove goal gold good government grand grass great ground
group grow guard guess guest guide gun hair half hall hammer hand hang happen happy hard head health
hear heart heat heavy help here high hill history hold hole holiday home honest hope horse hospital
hot hotel hour house however huge human hundred hungry hurry husband ice idea important inch
increase indeed information inside instead interest invent iron island jacket job join journey
juice jump just keep kind king kiss kitchen knee knife knock know lady lake land language large
last late laugh law lazy lead leaf learn leave left leg lesson letter level library lie life lift
light like line lion lip list listen little live lock long lose loud love low lucky lunch machine
main make many map mark market marry match matter meal mean measure meat medicine meet member memory
metal middle milk mind minute mirror miss mistake modern moment money monkey month moon more morning
mother mountain mouse mouth move much museum music must name narrow nation nature near neck need
needle neighbor nest net never new news next nice night nine noise none noon north nose note nothing
notice now number nurse object ocean offer often oil old once only open opinion orange order other
outside over own page pain paint pair paper parent park part party pass past path pay peace pen
pencil people pepper perhaps person picture piece pig pink place plan plane plant plate play please
pocket poem point police pool poor popular position possible potato pound powder power present
pretty price print prison private prize problem produce promise proud public pull pupil purple push
put queen quick quiet race radio rain raise reach ready real reason receive record rest rice rich
ride right ring rise road rock roll room root rope rose round row rule run sad safe sail salt same
sand save say school science sea season seat second secret see seed seem sell send sense sentence
serve set seven shade shake shape share sharp sheep shelf shine ship shirt shoe shop short shoulder
shout show shut sick side sign silver simple since sing sister size skin sky sleep slow small smell
smile smoke snake snow soap soft soldier some son song soon sorry sound soup south space speak
special speed spend spoon sport spring square stair stamp star start state stay steal steel step
stick still stone stop store storm story straight strange street strong student study sugar summer
sun supper sure surprise sweet swim table tail take talk tall taste tea teach tear telephone tell
ten tent test than thank thick thin thing think third thirsty thousand three through throw thumb
ticket tidy tie tiger time tiny tired today together tomorrow tongue tonight tool tooth top touch
towel tower town toy traffic travel tree trouble truck true try turn twelve twenty type ugly umbrella
uncle under understand uniform until upon upstairs use useful usual valley value vegetable very
village visit voice wait wake walk wall want war warm wash watch water wave way weak wear week weight
welcome well west wet wheel when where which while whisper wide wife wild win wind wine winter wish
woman wonder wood wool word work world worry write wrong yard year yellow yesterday young zero zoo
""".split()


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """A deterministic English training corpus: the text above plus generated sentences."""
    prose = [line for line in _CORPUS_TEXT.splitlines() if line.strip()]
    lines = prose * 4  # weight the prompt-like prose over the word lists
    for i, (subject, verb, place) in enumerate(itertools.product(_SUBJECTS, _VERBS, _PLACES)):
        if i % 7:  # a deterministic 1-in-7 subset keeps the corpus small
            continue
        time = _TIMES[i % len(_TIMES)]
        color = _COLORS[i % len(_COLORS)]
        thing = _THINGS[(i // 3) % len(_THINGS)]
        lines.append(f"{time.capitalize()} {subject} {verb} {place} with the {color} {thing}.")
        lines.append(f"Question: what does {subject} do {place}? Answer: {subject} {verb}. Frame {i % 97}.")
    n = len(_WORDS)
    for i, word in enumerate(_WORDS):  # every word a few times, in different company
        a, b = _WORDS[(i * 7 + 3) % n], _WORDS[(i * 13 + 5) % n]
        lines.append(f"The {word} and the {a}. A {b} {word}s near the {word}. {word.capitalize()}, {a}, {b}!")
    return tuple(lines)


@functools.lru_cache(maxsize=1)
def train_bpe() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Train the demo byte-level BPE (cached per process; deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_BPE_VOCAB,
        min_frequency=2,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = tuple(tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"])
    return dict(model["vocab"]), merges


def write(path: str | Path = DEMO_TOKENIZER) -> Path:
    """Train the BPE and write ``{"vocab", "merges"}`` to ``path`` (the demo's tokenizer file)."""
    vocab, merges = train_bpe()
    path = Path(path)
    path.write_text(json.dumps({"vocab": vocab, "merges": [list(m) for m in merges]}, ensure_ascii=False,
                               separators=(",", ":")), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEMO_TOKENIZER))
    print(f"wrote {write(parser.parse_args(argv).out)}")


if __name__ == "__main__":
    main()
