"""copies="auto" for the two-stage step: how many times to send each datagram,
chosen from the loss the step's own reduce-scatter measures.

The reduce half's agreed fraction says what share of all contributions reached
their owners; every rank sees the same figure (and knows how many contributions
a step carries), so every rank chooses the same number of copies without
another message. With k copies a chunk is lost with probability p**k. The chunk
loss is estimated over the last few thousand contributions (a small model's
step carries few, and once copies work few are lost: a per-step average would
swing), the datagram loss p is its k-th root, and the next step takes the
fewest copies whose chunk loss stays at or below the target. More copies are
taken at once; fewer only when the estimate is well inside the smaller number's
bound and rests on a whole memory of contributions sent at the current number, and
one copy at a time: just after a change the estimate is the old one carried over, and
a few steps without a loss (likely at 3 copies even at 15% loss) pulled it down to a
number that loses too much."""

# 1.5% of chunks: the measured cost of losing ~1% is within the training noise floor, and the
# bound sits between 10% loss at two copies (1%) and 1% loss at one, so neither common rate
# makes the choice flip (at exactly 1% it took three copies at 10% loss most of the time)
TARGET_CHUNK_LOSS = 0.015
MEMORY = 4000       # contributions the estimate remembers (older ones fade geometrically)
FEWER_MARGIN = 0.5  # fewer copies only if they would lose at most half the target


class CopiesChooser:
    """The copies each step sends, from the loss the previous steps measured.

    `chunks` is how many chunks the step's tensor has: with world_size - 1 other ranks'
    contributions to each, the count a reduce-scatter carries, the same on every rank."""

    def __init__(self, chunks, world_size, most, target=TARGET_CHUNK_LOSS):
        self.remote = (world_size - 1) / world_size  # share of contributions that travel
        self.contributions = chunks * (world_size - 1)
        self.most = most
        self.target = target
        self.copies = 1
        self.lost = 0.0   # contributions lost, remembered (at self.copies)
        self.seen = 0.0   # contributions sent, remembered
        self.seen_at_copies = 0  # contributions sent since self.copies last changed

    @property
    def datagram_loss(self):
        return (self.lost / self.seen) ** (1.0 / self.copies) if self.seen else 0.0

    def record(self, reduce_fraction):
        """After a lossy reduce-scatter sent with `self.copies`: update the estimate and choose."""
        if self.contributions == 0:  # one rank, or an empty tensor: nothing travels
            return self.copies
        chunk_loss = min(1.0, max(0.0, 1.0 - reduce_fraction) / self.remote)
        keep = max(0.0, 1.0 - self.contributions / MEMORY)
        self.lost = self.lost * keep + chunk_loss * self.contributions
        self.seen = self.seen * keep + self.contributions
        self.seen_at_copies += self.contributions
        loss = self.datagram_loss
        wanted = self.fewest_copies(loss, self.target)
        if wanted < self.copies:
            wanted = self.copies if self.seen_at_copies < MEMORY else \
                max(wanted, self.copies - 1, self.fewest_copies(loss, self.target * FEWER_MARGIN))
        if wanted != self.copies:
            self.lost = self.seen * loss ** wanted  # the same datagram loss, as chunk loss at the new number
            self.copies = wanted
            self.seen_at_copies = 0
        return self.copies

    def fewest_copies(self, loss, target):
        for copies in range(1, self.most + 1):
            if loss ** copies <= target:
                return copies
        return self.most
