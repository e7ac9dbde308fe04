"""Real English text for the FP8 accuracy measurement (benchmarks/fp8_accuracy.py): public-domain passages,
old enough that their copyright has long expired, written out here so the measurement needs no download.

EVAL is what the logits are compared on (about 1,100 SmolLM2 tokens over five passages: prose, oratory,
a legal preamble); CALIBRATION is a separate passage that only the static (per-tensor) activation scales
are calibrated on, so no variant sees the text it is scored on.
"""

from __future__ import annotations

EVAL = (
    # Abraham Lincoln, the Gettysburg Address (1863)
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We "
    "are met on a great battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is altogether fitting "
    "and proper that we should do this. But, in a larger sense, we can not dedicate, we can not consecrate, we "
    "can not hallow this ground. The brave men, living and dead, who struggled here, have consecrated it, far "
    "above our poor power to add or detract. The world will little note, nor long remember what we say here, "
    "but it can never forget what they did here. It is for us the living, rather, to be dedicated here to the "
    "unfinished work which they who fought here have thus far so nobly advanced.",
    # Jane Austen, Pride and Prejudice, chapter 1 (1813)
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
    "considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said "
    "his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that "
    "he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about "
    "it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken it?\" cried his wife "
    "impatiently. \"You want to tell me, and I have no objection to hearing it.\" This was invitation enough.",
    # Charles Dickens, A Tale of Two Cities, book 1, chapter 1 (1859)
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way - in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only.",
    # Herman Melville, Moby-Dick, chapter 1 (1851)
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse, "
    "and nothing particular to interest me on shore, I thought I would sail about a little and see the watery "
    "part of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever "
    "I find myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever "
    "I find myself involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral "
    "I meet; and especially whenever my hypos get such an upper hand of me, that it requires a strong moral "
    "principle to prevent me from deliberately stepping into the street, and methodically knocking people's "
    "hats off - then, I account it high time to get to sea as soon as I can.",
    # The Declaration of Independence, second paragraph (1776)
    "We hold these truths to be self-evident, that all men are created equal, that they are endowed by their "
    "Creator with certain unalienable Rights, that among these are Life, Liberty and the pursuit of "
    "Happiness. That to secure these rights, Governments are instituted among Men, deriving their just "
    "powers from the consent of the governed, That whenever any Form of Government becomes destructive of "
    "these ends, it is the Right of the People to alter or to abolish it, and to institute new Government, "
    "laying its foundation on such principles and organizing its powers in such form, as to them shall seem "
    "most likely to effect their Safety and Happiness. Prudence, indeed, will dictate that Governments long "
    "established should not be changed for light and transient causes; and accordingly all experience hath "
    "shewn, that mankind are more disposed to suffer, while evils are sufferable, than to right themselves "
    "by abolishing the forms to which they are accustomed.",
)

CALIBRATION = (
    # Arthur Conan Doyle, A Scandal in Bohemia (1891)
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any other name. "
    "In his eyes she eclipses and predominates the whole of her sex. It was not that he felt any emotion akin "
    "to love for Irene Adler. All emotions, and that one particularly, were abhorrent to his cold, precise "
    "but admirably balanced mind. He was, I take it, the most perfect reasoning and observing machine that "
    "the world has seen, but as a lover he would have placed himself in a false position.",
)
