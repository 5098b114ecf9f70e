"""A fixed list of common, short English words.

Each is a single token (with its leading space) in the common BPE vocabularies (GPT-2, Llama 3, Qwen2),
so "one word per token" is a good guess for an unknown tokenizer. The order is part of the seeded
output: changing this list changes every generated prompt.
"""

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was that for on with as by at from his her they this had not are but
    have one which were all their there been has when who will more would out so up said what
    its about than into them can only other new some could time these two may then first any
    like now over such our man me even most made after also did many before must through back
    years where much your way well down should because each just those people how too little
    state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since against
    go came right used take three states himself few house use during without again place around
    however home small found thought went say part once general high upon school every does got
    united left number course war until always away something fact though water less public put
    think almost hand enough far took head yet government system better set told nothing night
    end why called didn find going look asked later knew point next program city business give
    group toward young days let room president side social given present several order national
    possible rather second face per among form important often things looked early white case
    john become large big need four within felt along children saw best church ever least power
    development light thing seemed family interest want members mind country area others done
    turned although open god service certain kind problem began different door thus help sense
    means whole matter perhaps itself york times law human line above name example action company
    hands local show five whether history gave today either act feet across taken past quite
    anything seen having death week experience body word half really field car words already
    themselves information tell college shall money period held keep sure free real probably seems
    """.split()
)
