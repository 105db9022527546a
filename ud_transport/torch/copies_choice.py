"""copies="auto" for the two-stage step: how many times to send each datagram,
chosen from the loss the step's own reduce-scatter measures.

The reduce half's agreed fraction says what share of all contributions reached
their owners; every rank sees the same figure, so every rank chooses the same
number of copies without another message. With k copies a chunk is lost with
probability p**k. The chunk loss is averaged over steps (as chunk loss: its
k-th root would be biased low, most steps losing nothing), the datagram loss p
is its k-th root, and the next step takes the fewest copies whose chunk loss
stays at or below the target. More copies are taken at once; fewer only when
the estimate is well inside the smaller number's bound, so that a quiet stretch
(few chunks are lost once copies work) does not flip it back and forth."""

TARGET_CHUNK_LOSS = 0.01  # 1% of chunks: the measured cost of 1% loss is within the noise floor
SMOOTHING = 0.95          # weight of the past in the running chunk loss
FEWER_MARGIN = 0.5        # fewer copies only if they would lose at most half the target


class CopiesChooser:
    """The copies each step sends, from the loss the previous steps measured."""

    def __init__(self, world_size, most, target=TARGET_CHUNK_LOSS):
        self.world_size = world_size
        self.most = most
        self.target = target
        self.copies = 1
        self.chunk_loss = 0.0  # running, at self.copies

    @property
    def datagram_loss(self):
        return self.chunk_loss ** (1.0 / self.copies)

    def record(self, reduce_fraction):
        """After a lossy reduce-scatter sent with `self.copies`: update the estimate and choose."""
        if self.world_size < 2:
            return self.copies
        remote = (self.world_size - 1) / self.world_size  # own contributions never travel
        measured = min(1.0, max(0.0, 1.0 - reduce_fraction) / remote)
        self.chunk_loss = SMOOTHING * self.chunk_loss + (1 - SMOOTHING) * measured
        loss = self.datagram_loss
        wanted = self.fewest_copies(loss, self.target)
        if wanted < self.copies:
            wanted = max(wanted, self.fewest_copies(loss, self.target * FEWER_MARGIN))
        if wanted != self.copies:
            self.chunk_loss = loss ** wanted  # the same datagram loss, as chunk loss at the new number
            self.copies = wanted
        return self.copies

    def fewest_copies(self, loss, target):
        for copies in range(1, self.most + 1):
            if loss ** copies <= target:
                return copies
        return self.most
